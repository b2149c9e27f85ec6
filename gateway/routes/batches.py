"""The OpenAI Batch API routes: ``/v1/files`` and ``/v1/batches`` (OpenAI's shapes and errors)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web

from gateway.batches import BatchStore, new_batch, public
from gateway.http_common import error_response, read_json_body
from gateway.parts import SETTINGS_KEY, STORES_KEY
from protocol.api import BatchBody, parse_request
from protocol.errors import ErrorCode, SIEError, invalid_input

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
FILE_PURPOSES = ("batch",)
MAX_LIST = 100


def openai_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except SIEError as err:
            return error_response(err, openai=True)

    return wrapped


def _store(request: web.Request) -> BatchStore:
    store = request.app[STORES_KEY].batches
    if store is None:
        raise SIEError(ErrorCode.QUEUE_UNAVAILABLE, "The batch store is not ready", retry_after=2)
    return store


@openai_errors
async def handle_file_upload(request: web.Request) -> web.Response:
    """``POST /v1/files`` (multipart: ``purpose`` and ``file``), streamed up to the size limit."""
    limit = request.app[SETTINGS_KEY].batch_max_file_bytes
    if not (request.content_type or "").startswith("multipart/"):
        raise invalid_input("Upload the file as multipart/form-data with fields 'purpose' and 'file'")
    try:
        purpose, filename, data = await _read_upload(request, limit)
    except SIEError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed multipart (bad names, encodings, framing)
        raise invalid_input(
            f"The upload is not readable multipart/form-data ({type(exc).__name__})"
        ) from None
    if purpose not in FILE_PURPOSES:
        raise invalid_input(f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
    if data is None:
        raise invalid_input("The upload has no 'file' field", param="file")
    meta = await _store(request).put_file(bytes(data), filename=filename, purpose=purpose)
    return web.json_response(meta)


async def _read_upload(request: web.Request, limit: int) -> tuple[str | None, str, bytearray | None]:
    """``purpose``, the file's name and its bytes (None: no ``file`` field) from the multipart body."""
    purpose: str | None = None
    filename = "upload.jsonl"
    data: bytearray | None = None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue  # a nested multipart: nothing of ours
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename = part.filename or filename
            data = bytearray()
            while chunk := await part.read_chunk(65536):
                data += chunk
                if len(data) > limit:
                    raise SIEError(
                        ErrorCode.INPUT_TOO_LONG,
                        f"The file is larger than this gateway takes ({limit} bytes, SIE_BATCH_MAX_FILE_BYTES)",
                        param="file",
                        status=413,
                    )
    return purpose, filename, data


@openai_errors
async def handle_file_list(request: web.Request) -> web.Response:
    files = await _store(request).list_records("file")
    purpose = request.query.get("purpose")
    if purpose:
        files = [f for f in files if f.get("purpose") == purpose]
    files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=True)
    return web.json_response({"object": "list", "data": files, "has_more": False})


@openai_errors
async def handle_file_get(request: web.Request) -> web.Response:
    return web.json_response(await _store(request).file(request.match_info["file_id"]))


@openai_errors
async def handle_file_content(request: web.Request) -> web.StreamResponse:
    """The file's bytes, one part at a time (a batch's output file is its chunks' objects), so a
    large file is never whole in the gateway's memory. The first part is read before the answer
    starts, so a file already gone is still a 404; a part gone after that ends the answer short of
    its Content-Length, which a client sees as a broken transfer."""
    store = _store(request)
    file_id = request.match_info["file_id"]
    meta, parts = await store.file_parts(file_id)
    first = await store.part(file_id, parts[0]) if parts else b""
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = meta["bytes"]
    await response.prepare(request)
    await response.write(first)
    for name in parts[1:]:
        try:
            data = await store.part(file_id, name)
        except SIEError:  # deleted while it was being sent: the answer cannot say so now
            log.warning("file %s: part %s is gone; its answer breaks off", file_id, name)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write(data)
    await response.write_eof()
    return response


@openai_errors
async def handle_file_delete(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    await _store(request).delete_file(file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


@openai_errors
async def handle_batch_create(request: web.Request) -> web.Response:
    body = await read_json_body(request, "The body")
    store = _store(request)
    parsed = parse_request(BatchBody, body)
    batch = new_batch(parsed, await store.file(parsed.input_file_id))
    await store.create_batch(batch, request.headers.get("Authorization"))
    return web.json_response(batch)


@openai_errors
async def handle_batch_get(request: web.Request) -> web.Response:
    record, _ = await _store(request).batch(request.match_info["batch_id"])
    return web.json_response(public(record))


@openai_errors
async def handle_batch_list(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise invalid_input("limit must be an integer", param="limit") from None
    if not 1 <= limit <= MAX_LIST:
        raise invalid_input(f"limit must be between 1 and {MAX_LIST}", param="limit")
    batches = sorted(
        (public(b) for b in await _store(request).list_records("batch")),
        key=lambda b: (b["created_at"], b["id"]),
        reverse=True,
    )
    after = request.query.get("after")
    if after:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1 :] if after in ids else []
    page = batches[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(batches) > limit,
        }
    )


@openai_errors
async def handle_batch_cancel(request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]

    def cancel(r: dict[str, Any]) -> bool:
        if r["status"] not in ("validating", "in_progress"):
            return False
        r.update(status="cancelling", cancelling_at=int(time.time()))
        return True

    record = await _store(request).update_batch(batch_id, cancel)
    if record["status"] not in ("cancelling", "cancelled"):
        raise SIEError(
            ErrorCode.INVALID_INPUT,
            f"Batch '{batch_id}' is {record['status']}; it cannot be cancelled",
            param="id",
        )
    return web.json_response(public(record))
