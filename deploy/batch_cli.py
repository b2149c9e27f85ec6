"""``sie batch``: submit a file of texts (or of OpenAI batch request lines) to the cluster's Batch
API, follow it with a progress bar and write the output file at the end; ``status`` and ``cancel``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from deploy.state import NoCluster, find_state_dir
from deploy.supervisor import read_status

ENDED = ("completed", "failed", "expired", "cancelled")


class BatchError(Exception):
    pass


def gateway_url(url: str | None, state_dir: str | None) -> str:
    """``url``, else SIE_URL, else the gateway of the running ``sie up``."""
    if url or os.environ.get("SIE_URL"):
        return str(url or os.environ["SIE_URL"]).rstrip("/")
    try:
        state = find_state_dir(state_dir)
    except NoCluster as exc:
        raise BatchError(f"{exc}; or name the gateway with --url (or SIE_URL)") from None
    found = (read_status(state) or {}).get("gateway_url")
    if not found:
        raise BatchError("the running sie up has no gateway URL yet; name it with --url")
    return str(found).rstrip("/")


def request_lines(data: bytes, model: str | None, endpoint: str) -> bytes:
    """The batch input file: request lines as they are (their ``model`` filled in from ``model``
    where absent), or one request per line of text (a JSON string or the raw line)."""
    out = []
    for number, raw in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw
        if isinstance(parsed, dict) and "custom_id" in parsed:
            body = parsed.setdefault("body", {})
            if model and isinstance(body, dict):
                body.setdefault("model", model)
            out.append(parsed)
            continue
        if not model:
            raise BatchError("a file of texts needs --model")
        text = parsed if isinstance(parsed, str) else raw
        if endpoint == "/v1/embeddings":
            line = {"url": endpoint, "body": {"model": model, "input": text}}
        else:
            line = {"url": f"/v1/encode/{model}", "body": {"items": [{"text": text}]}}
        out.append({"custom_id": f"line-{number}", "method": "POST", **line})
    if not out:
        raise BatchError("the file holds no lines")
    return b"".join(json.dumps(line).encode() + b"\n" for line in out)


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str, token: str | None) -> None:
        self.session = session
        self.base = base
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        async with self.session.request(method, self.base + path, headers=self.headers, **kw) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                try:
                    message = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = raw.decode("utf-8", "replace")[:300]
                raise BatchError(f"{method} {path}: {resp.status} {message}")
            return json.loads(raw) if resp.content_type == "application/json" else raw


def bar(batch: dict[str, Any], width: int = 30) -> str:
    counts = batch.get("request_counts") or {}
    total, done = counts.get("total") or 0, (counts.get("completed") or 0) + (counts.get("failed") or 0)
    filled = int(width * done / total) if total else 0
    failed = f", {counts.get('failed')} failed" if counts.get("failed") else ""
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total or '?'} lines{failed} ({batch['status']})"


async def _submit(
    path: Path,
    model: str | None,
    endpoint: str,
    base: str,
    token: str | None,
    output: Path,
    poll_s: float,
    err: TextIO,
) -> int:
    content = request_lines(path.read_bytes(), model, endpoint)
    async with aiohttp.ClientSession() as session:
        api = Client(session, base, token)
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename=path.name, content_type="application/jsonl")
        uploaded = await api.call("POST", "/v1/files", data=form)
        batch = await api.call(
            "POST",
            "/v1/batches",
            json={"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"},
        )
        lines = content.count(b"\n")
        print(f"batch {batch['id']} submitted ({lines} lines)", file=err)
        try:
            while batch["status"] not in ENDED:
                print("\r" + bar(batch), end="", file=err, flush=True)
                await asyncio.sleep(poll_s)
                batch = await api.call("GET", f"/v1/batches/{batch['id']}")
        except (KeyboardInterrupt, asyncio.CancelledError):
            print(f"\nbatch {batch['id']} goes on in the cluster: sie batch status {batch['id']}", file=err)
            raise
        print("\r" + bar(batch), file=err)
        if batch["status"] == "failed":
            for e in (batch.get("errors") or {}).get("data") or []:
                print(f"line {e.get('line')}: {e.get('message')}", file=err)
            return 1
        if batch.get("output_file_id"):
            output.write_bytes(await api.call("GET", f"/v1/files/{batch['output_file_id']}/content"))
            print(f"output: {output}", file=err)
        if batch.get("error_file_id"):
            errors = output.with_name(output.stem + ".errors.jsonl")
            errors.write_bytes(await api.call("GET", f"/v1/files/{batch['error_file_id']}/content"))
            print(f"lines that failed: {errors}", file=err)
        return 0 if batch["status"] == "completed" and not batch.get("error_file_id") else 1


async def _one(method: str, path: str, base: str, token: str | None) -> Any:
    async with aiohttp.ClientSession() as session:
        return await Client(session, base, token).call(method, path)


def submit(
    file: str,
    model: str | None,
    endpoint: str,
    url: str | None,
    token: str | None,
    state_dir: str | None,
    output: str | None,
    poll_s: float = 1.0,
) -> int:
    path = Path(file)
    out = Path(output) if output else path.with_name(path.stem + ".out.jsonl")
    try:
        base = gateway_url(url, state_dir)
        started = time.monotonic()
        code = asyncio.run(
            _submit(
                path, model, endpoint, base, token or os.environ.get("SIE_API_KEY"), out, poll_s, sys.stderr
            )
        )
        print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
        return code
    except (BatchError, OSError, aiohttp.ClientError) as exc:
        print(f"sie batch: {exc}", file=sys.stderr)
        return 1


def status(
    batch_id: str, url: str | None, token: str | None, state_dir: str | None, cancel: bool = False
) -> int:
    try:
        base = gateway_url(url, state_dir)
        path = f"/v1/batches/{batch_id}" + ("/cancel" if cancel else "")
        batch = asyncio.run(
            _one("POST" if cancel else "GET", path, base, token or os.environ.get("SIE_API_KEY"))
        )
    except (BatchError, OSError, aiohttp.ClientError) as exc:
        print(f"sie batch: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(batch, indent=2))
    print(bar(batch), file=sys.stderr)
    return 0
