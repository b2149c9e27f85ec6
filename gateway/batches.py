"""The OpenAI Batch API's state and its runner: files and batches kept in JetStream, so that any
gateway replica answers for any batch and one that dies mid-batch loses nothing.

Where things live (every replica opens the same buckets):

- ``SIE_FILES`` (object store): file contents, input files and the output and error files;
- ``SIE_BATCHES`` (key-value): ``file.<id>`` and ``batch.<id>``, the objects the API returns;
- ``SIE_BATCH_LEASES`` (key-value): one key per batch not yet ended, naming the gateway running it
  and until when. A gateway renews its leases; another takes a batch over once its lease ran out.

A batch runs in chunks of ``batch_chunk_lines`` lines. Each line is sent to this gateway's own HTTP
front door with ``X-SIE-Priority: bulk`` (the same checks, errors and queue as any request, behind
interactive traffic). A chunk's output and error lines are written as objects named by the batch
and chunk before the batch record counts the chunk done, with a compare-and-set on its revision: a
gateway that takes over redoes at most the chunk in flight and writes the same objects again, so
no line is lost and none appears twice in the output file. At the end the output and error files
are records that name their chunks' objects as their parts, in order: nothing is read back or
copied (joining them had read and written a 200-line batch's 23 MB of vectors twice, on the event
loop interactive requests share, in its last seconds), and a file's content is sent part by part.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import aiohttp
import nats.errors
import nats.js.errors
import orjson
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from gateway.kv import KeyValueMirror, bucket_keys
from iokit.payloads import drop_idle_readers
from protocol.api import BatchBody
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.subjects import BULK

log = logging.getLogger(__name__)

FILES_BUCKET = "SIE_FILES"
RECORDS_BUCKET = "SIE_BATCHES"
LEASES_BUCKET = "SIE_BATCH_LEASES"
ENDPOINTS = ("/v1/embeddings", "/v1/encode")  # a native encode line's url is /v1/encode/<model>
COMPLETION_WINDOWS = {"24h": 24 * 3600}
ENDED = ("completed", "failed", "expired", "cancelled")


class FileObject(TypedDict):
    """A file as ``/v1/files`` shows it (OpenAI's file object)."""

    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None
    expires_at: int | None


class LineError(TypedDict):
    """One problem of an input file (an entry of OpenAI's ``errors.data``)."""

    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(TypedDict):
    """A batch's ``errors``."""

    object: str
    data: list[LineError]


# a line answered 429, 503 or PROVISIONING is sent again (after its Retry-After) until the batch
# expires; other server errors at most this many times before the line counts as failed
SERVER_ERROR_TRIES = 3


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def not_found(what: str, ident: str) -> SIEError:
    return SIEError(ErrorCode.NOT_FOUND, f"No {what} with id '{ident[:100]}'", param="id")


_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def checked_id(what: str, ident: str) -> str:
    """``ident`` when it can name a file or batch (the ids this module makes), else 404: anything
    else is no key of ours, and some characters are not even a valid key."""
    if not _ID.fullmatch(ident):
        raise not_found(what, ident)
    return ident


# ---- state in JetStream -------------------------------------------------------------------------


class BatchStore:
    """Files and batch records in JetStream (see the module's docstring)."""

    def __init__(self, files: ObjectStore, records: KeyValue, leases: KeyValue) -> None:
        self.files = files
        self.records = records
        self.leases = leases
        self.lease_view = KeyValueMirror(leases, LEASES_BUCKET)  # what claims read; run by the runner

    @classmethod
    async def open(cls, js: JetStreamContext, *, storage: str = "file", replicas: int = 1) -> BatchStore:
        st = StorageType.FILE if storage == "file" else StorageType.MEMORY
        try:
            files = await js.object_store(FILES_BUCKET)
        except nats.js.errors.NotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):  # another replica made it first
                await js.create_object_store(
                    FILES_BUCKET, ObjectStoreConfig(storage=st, replicas=replicas, description="batch files")
                )
            files = await js.object_store(FILES_BUCKET)
        await drop_idle_readers(js, FILES_BUCKET)  # a batch's end reads every chunk's objects
        kvs = []
        for bucket in (RECORDS_BUCKET, LEASES_BUCKET):
            try:
                kv = await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                with contextlib.suppress(nats.js.errors.BadRequestError):
                    await js.create_key_value(
                        KeyValueConfig(bucket=bucket, history=1, storage=st, replicas=replicas)
                    )
                kv = await js.key_value(bucket)
            kvs.append(kv)
        return cls(files, kvs[0], kvs[1])

    # files
    async def put_file(
        self, data: bytes, *, filename: str, purpose: str, file_id: str | None = None
    ) -> FileObject:
        file_id = file_id or new_id("file-")
        await self.files.put(file_id, data)
        return await self._put_file_record(file_id, len(data), filename=filename, purpose=purpose)

    async def put_parts_file(
        self, parts: list[str], size: int, *, filename: str, purpose: str, file_id: str
    ) -> FileObject:
        """A file whose content is the objects ``parts`` (``size`` bytes together), in order."""
        return await self._put_file_record(file_id, size, filename=filename, purpose=purpose, parts=parts)

    async def _put_file_record(
        self, file_id: str, size: int, *, filename: str, purpose: str, parts: list[str] | None = None
    ) -> FileObject:
        meta: FileObject = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }
        record: dict[str, object] = {**meta} if parts is None else {**meta, "_parts": parts}
        await self.records.put(f"file.{file_id}", json.dumps(record).encode())
        return meta

    async def file(self, file_id: str) -> dict[str, Any]:
        """The file object as the API returns it."""
        return public(await self._file_record(file_id))

    async def _file_record(self, file_id: str) -> dict[str, Any]:
        record = await self._get(f"file.{checked_id('file', file_id)}")
        if record is None:
            raise not_found("file", file_id)
        return record[0]

    async def file_parts(self, file_id: str) -> tuple[dict[str, Any], list[str]]:
        """The file object and the objects its content is, in order: its parts, or the one object
        named by its id."""
        record = await self._file_record(file_id)
        parts = record.get("_parts")
        return public(record), [file_id] if parts is None else list(parts)

    async def part(self, file_id: str, name: str) -> bytes:
        try:
            got = await self.files.get(name)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            raise not_found("file", file_id) from None
        return got.data or b""

    async def file_content(self, file_id: str) -> bytes:
        _, parts = await self.file_parts(file_id)
        return b"".join([await self.part(file_id, name) for name in parts])

    async def delete_file(self, file_id: str) -> None:
        _, parts = await self.file_parts(file_id)
        for name in parts:
            await self.delete_object(name)
        await self.records.delete(f"file.{file_id}")

    async def delete_object(self, name: str) -> None:
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            await self.files.delete(name)

    async def object_size(self, name: str) -> int | None:
        """Bytes of the object ``name``; None when there is none."""
        try:
            return int((await self.files.get_info(name)).size or 0)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return None

    async def list_records(self, kind: str) -> list[dict[str, Any]]:
        out = []
        for key in await bucket_keys(self.records):
            if key.startswith(kind + "."):
                record = await self._get(key)
                if record is not None:
                    out.append(public(record[0]))
        return out

    # batches
    async def create_batch(self, batch: dict[str, Any], auth: str | None) -> None:
        await self.records.put(f"batch.{batch['id']}", json.dumps({**batch, "_auth": auth}).encode())
        await self.leases.put(batch["id"], json.dumps({"owner": "", "until": 0}).encode())

    async def batch(self, batch_id: str) -> tuple[dict[str, Any], int]:
        """The stored record (with its private fields) and its revision."""
        record = await self._get(f"batch.{checked_id('batch', batch_id)}")
        if record is None:
            raise not_found("batch", batch_id)
        return record

    async def update_batch(self, batch_id: str, change: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Apply ``change`` to the record and store it if it returns True, retried on a concurrent
        write (compare-and-set on the revision). Returns the record as stored."""
        while True:
            record, revision = await self.batch(batch_id)
            if not change(record):
                return record
            try:
                await self.records.update(f"batch.{batch_id}", json.dumps(record).encode(), last=revision)
                return record
            except nats.js.errors.KeyWrongLastSequenceError:
                continue

    async def _get(self, key: str) -> tuple[dict[str, Any], int] | None:
        try:
            entry = await self.records.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if not entry.value:
            return None
        return json.loads(entry.value), int(entry.revision or 0)

    # leases
    def claimable(self, owner: str, now: float) -> list[tuple[str, int]]:
        """Batches whose lease ran out (or is ``owner``'s own from an earlier life): id and revision,
        as the lease view holds them (a moment behind: taking a lease compares its revision)."""
        out = []
        for key, entry in list(self.lease_view.entries.items()):
            lease = json.loads(entry.value or b"{}")
            if lease.get("until", 0) < now or lease.get("owner") == owner:
                out.append((key, int(entry.revision or 0)))
        return out

    async def take_lease(self, batch_id: str, owner: str, until: float, revision: int) -> int | None:
        """The new revision of the lease when it was ours to take or renew, else None."""
        try:
            return int(
                await self.leases.update(
                    batch_id, json.dumps({"owner": owner, "until": until}).encode(), last=revision
                )
            )
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            return None

    async def end_lease(self, batch_id: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self.leases.delete(batch_id)


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch object as the API returns it (no private fields)."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}


# ---- the input file -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as OpenAI's errors count lines
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_input(data: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[LineError]]:
    """The request lines of an input file and the problems found (OpenAI's ``errors.data``)."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()

    def problem(number: int | None, message: str, param: str | None = None) -> None:
        errors.append({"code": "invalid_request", "message": message, "param": param, "line": number})

    raw_lines = [raw for raw in data.splitlines() if raw.strip()]
    if not raw_lines:
        problem(None, "The input file holds no request lines")
    if len(raw_lines) > max_lines:
        problem(
            None, f"The input file holds {len(raw_lines)} request lines; a batch takes at most {max_lines}"
        )
        return [], errors
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            problem(number, "This line is not valid JSON")
            continue
        if not isinstance(line, dict):
            problem(number, "A request line must be a JSON object")
            continue
        custom_id, method, url, body = (line.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            problem(number, "custom_id must be a non-empty string", "custom_id")
        elif custom_id in seen:
            problem(number, f"custom_id '{custom_id}' appears more than once in the file", "custom_id")
        elif method != "POST":
            problem(number, "method must be POST", "method")
        elif not isinstance(url, str) or not _url_fits(url, endpoint):
            problem(number, f"url must be {endpoint}{'/<model>' if endpoint == '/v1/encode' else ''}", "url")
        elif not isinstance(body, dict):
            problem(number, "body must be a JSON object", "body")
        else:
            seen.add(custom_id)
            lines.append(Line(number, custom_id, url, body))
    return lines, errors


def one_line_json(raw: bytes) -> bytes:
    """``raw`` as one line of JSON for an output file: kept as it is when it is JSON on one line
    (the gateway's own compact answers), else re-encoded, or wrapped as an error message."""
    raw = raw.strip()
    if raw and b"\n" not in raw and raw[:1] in (b"{", b"["):
        return raw
    try:
        return orjson.dumps(orjson.loads(raw)) if raw else b"null"
    except orjson.JSONDecodeError:
        return orjson.dumps({"error": {"message": raw.decode("utf-8", "replace")[:500]}})


def _url_fits(url: str, endpoint: str) -> bool:
    if endpoint == "/v1/encode":
        return url.startswith("/v1/encode/") and len(url) > len("/v1/encode/")
    return url == endpoint


# ---- the runner ---------------------------------------------------------------------------------


Send = Callable[[str, dict[str, Any], str | None], Awaitable[tuple[int, dict[str, str], Any]]]


class BatchRunner:
    """Claims batches whose lease ran out and runs them (one task per batch), renewing its leases."""

    def __init__(
        self,
        store: BatchStore,
        owner: str,
        *,
        base_url: str | None = None,
        lines_in_flight: int = 16,
        chunk_lines: int = 200,
        max_lines: int = 50_000,
        lease_s: float = 15.0,
        poll_s: float = 1.0,
    ) -> None:
        self.store = store
        self.owner = owner
        self.base_url = base_url  # this gateway's own front door; lines wait until it is known
        self.lines_in_flight = lines_in_flight
        self.chunk_lines = chunk_lines
        self.max_lines = max_lines
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.running: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        """Until cancelled: claim what is claimable, every ``poll_s``."""
        view = asyncio.create_task(self.store.lease_view.run(), name="batch-lease-view")
        try:
            while True:
                try:
                    await self.claim()
                except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                    log.warning("batch claim pass failed: %s", exc)
                await asyncio.sleep(self.poll_s)
        finally:
            view.cancel()
            for task in self.running.values():
                task.cancel()
            for task in [view, *self.running.values()]:
                with contextlib.suppress(BaseException):
                    await task
            if self._session is not None:
                await self._session.close()

    async def claim(self) -> None:
        if self.base_url is None:
            return
        for batch_id, revision in self.store.claimable(self.owner, time.time()):
            if batch_id in self.running:
                continue
            taken = await self.store.take_lease(batch_id, self.owner, time.time() + self.lease_s, revision)
            if taken is None:
                continue  # another gateway was quicker
            log.info("batch %s: running it here (%s)", batch_id, self.owner)
            task = asyncio.create_task(self._run(batch_id, taken), name=f"batch-{batch_id}")
            self.running[batch_id] = task
            task.add_done_callback(functools.partial(self._finished, batch_id))

    def _finished(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self.running.pop(batch_id, None)

    async def _run(self, batch_id: str, lease_revision: int) -> None:
        renew = asyncio.create_task(self._renew(batch_id, lease_revision))
        work = asyncio.create_task(self._work(batch_id))
        try:
            done, _ = await asyncio.wait({work, renew}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                log.warning("batch %s: lease lost; leaving it to the gateway that took it", batch_id)
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        except Exception:
            log.exception("batch %s failed here; another pass (or gateway) takes it up again", batch_id)
        finally:
            renew.cancel()
            with contextlib.suppress(BaseException):
                await renew

    async def _renew(self, batch_id: str, revision: int) -> None:
        """Renew the lease every third of its length; returns when another gateway holds it."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                got = await self.store.take_lease(batch_id, self.owner, time.time() + self.lease_s, revision)
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("batch %s: lease renewal failed (%s); trying again", batch_id, exc)
                continue
            if got is None:
                return
            revision = got

    async def _work(self, batch_id: str) -> None:
        record, _ = await self.store.batch(batch_id)
        if record["status"] in ENDED:
            await self.store.end_lease(batch_id)
            return
        data = await self.store.file_content(record["input_file_id"])
        lines, errors = parse_input(data, record["endpoint"], self.max_lines)
        if errors:
            await self._end(batch_id, "failed", errors={"object": "list", "data": errors[:100]})
            return
        if record["status"] == "validating":

            def start(r: dict[str, Any]) -> bool:
                if r["status"] != "validating":
                    return False
                r.update(status="in_progress", in_progress_at=int(time.time()))
                r["request_counts"]["total"] = len(lines)
                return True

            record = await self.store.update_batch(batch_id, start)
        chunks = [lines[i : i + self.chunk_lines] for i in range(0, len(lines), self.chunk_lines)]
        while True:
            record, _ = await self.store.batch(batch_id)
            if record["status"] == "cancelling":
                await self._end(batch_id, "cancelled")
                return
            if time.time() >= record["expires_at"]:
                await self._end(batch_id, "expired")
                return
            done = int(record.get("_chunks_done", 0))
            if done >= len(chunks):
                break
            chunk = asyncio.create_task(self._chunk(batch_id, done, chunks[done], auth=record.get("_auth")))
            try:
                while not chunk.done():  # a cancel does not wait for the chunk (its lines may be waiting)
                    await asyncio.wait({chunk}, timeout=self.poll_s)
                    if not chunk.done() and (await self.store.batch(batch_id))[0]["status"] == "cancelling":
                        chunk.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await chunk
                        await self._end(batch_id, "cancelled")
                        return
            finally:
                chunk.cancel()
            ok, failed = chunk.result()

            def count(r: dict[str, Any], n: int = done, ok: int = ok, failed: int = failed) -> bool:
                if int(r.get("_chunks_done", 0)) != n:
                    return False  # counted already (by a gateway that ran it too)
                r["_chunks_done"] = n + 1
                r["request_counts"]["completed"] += ok
                r["request_counts"]["failed"] += failed
                return True

            await self.store.update_batch(batch_id, count)
        await self._end(batch_id, "completed")

    async def _chunk(self, batch_id: str, index: int, lines: list[Line], auth: str | None) -> tuple[int, int]:
        """Run one chunk's lines and store its output and error lines; (succeeded, failed)."""
        gate = asyncio.Semaphore(self.lines_in_flight)

        async def one(line: Line) -> tuple[bool, bytes]:
            async with gate:
                return await self._line(batch_id, line, auth)

        answers = await asyncio.gather(*(one(line) for line in lines))
        out = b"".join(a for good, a in answers if good)
        err = b"".join(a for good, a in answers if not good)
        await self.store.files.put(f"{batch_id}/out/{index:06d}", out)
        await self.store.files.put(f"{batch_id}/err/{index:06d}", err)
        ok = sum(1 for good, _ in answers if good)
        return ok, len(answers) - ok

    async def _line(self, batch_id: str, line: Line, auth: str | None) -> tuple[bool, bytes]:
        """Send one line until it has an answer; (succeeded, its output or error file line)."""
        server_errors = 0
        while True:
            try:
                status, headers, body = await self._send(line.url, line.body, auth)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, headers = 599, {}
                body = orjson.dumps({"error": {"message": f"{type(exc).__name__}: {exc}"}})
            waiting = status in (202, 429) or (status == 503 and "Retry-After" in headers)
            if waiting or (status >= 500 and server_errors + 1 < SERVER_ERROR_TRIES):
                server_errors += 0 if waiting else 1
                retry = headers.get("Retry-After")
                await asyncio.sleep(min(float(retry), 30.0) if retry else 1.0)
                continue
            envelope = orjson.dumps({
                "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line.number}",
                "custom_id": line.custom_id,
                "response": {"status_code": status, "request_id": headers.get("X-SIE-Request-ID", ""), "body": None},
                "error": None,
            })  # fmt: skip
            # the answer's JSON goes into the line as it came: parsing and encoding again thousands
            # of vectors per chunk held the event loop that interactive requests share
            return 200 <= status < 300, envelope.replace(b'"body":null', b'"body":' + body, 1) + b"\n"

    async def _send(
        self, url: str, body: dict[str, Any], auth: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        """POST one line's body to this gateway; (status, headers, the answer as one line of JSON)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        headers = {"X-SIE-Priority": BULK, "Accept": "application/json"}
        if auth:
            headers["Authorization"] = auth
        async with self._session.post(f"{self.base_url}{url}", json=body, headers=headers) as resp:
            return resp.status, dict(resp.headers), one_line_json(await resp.read())

    async def _end(self, batch_id: str, status: str, *, errors: BatchErrors | None = None) -> None:
        """Record the output and error files (the counted chunks' objects as their parts) and the
        batch's end. Run again by a gateway that takes the batch over, it writes the same records."""
        record, _ = await self.store.batch(batch_id)
        if status != "failed":

            def finalizing(r: dict[str, Any]) -> bool:
                if r["status"] != "in_progress":
                    return False
                r.update(status="finalizing", finalizing_at=int(time.time()))
                return True

            await self.store.update_batch(batch_id, finalizing)
        chunks = int(record.get("_chunks_done", 0))
        files: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for kind, field in (("out", "output_file_id"), ("err", "error_file_id")):
            parts, size = [], 0
            for index in range(chunks):
                name = f"{batch_id}/{kind}/{index:06d}"
                got = await self.store.object_size(name)
                if got:
                    parts.append(name)
                    size += got
                elif got == 0:
                    await self.store.delete_object(name)  # an empty chunk adds nothing
            if parts or (kind == "out" and status == "completed"):
                meta = await self.store.put_parts_file(
                    parts,
                    size,
                    filename=f"{batch_id}_{'output' if kind == 'out' else 'error'}.jsonl",
                    purpose="batch_output",
                    file_id=f"file-{batch_id.removeprefix('batch_')}{kind}",
                )
                files[field] = meta["id"]
        now = int(time.time())

        def end(r: dict[str, Any]) -> bool:
            if r["status"] in ENDED:
                return False
            r.update(status=status, **files)
            r[f"{status}_at"] = now
            if errors is not None:
                r["errors"] = errors
            return True

        await self.store.update_batch(batch_id, end)
        for kind in ("out", "err"):  # what a chunk in flight (not counted) may have written
            await self.store.delete_object(f"{batch_id}/{kind}/{chunks:06d}")
        await self.store.end_lease(batch_id)
        log.info("batch %s %s", batch_id, status)


def new_batch(body: BatchBody, input_file: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """The batch object ``POST /v1/batches`` creates from its (parsed) body."""
    if input_file.get("purpose") != "batch":
        raise invalid_input("The input file's purpose must be 'batch'", param="input_file_id")
    created = int(now if now is not None else time.time())
    return {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": input_file["id"],
        "completion_window": body.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + COMPLETION_WINDOWS[body.completion_window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }
