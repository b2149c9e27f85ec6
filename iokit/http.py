"""HTTP plumbing shared by every front door (worker serve, gateway): body limits, decoding, responses."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from protocol import SERVER_VERSION, rerank
from protocol.codec import (
    CodecError,
    check_plain,
    dumps_json,
    packb,
    unpackb,
    wants_msgpack_body,
    wants_msgpack_response,
)
from protocol.errors import ErrorCode, SIEError, invalid_input


def _input_too_long(limit: int, declared: int | None) -> Exception:
    if declared is not None:
        message = f"Request body of {declared} bytes exceeds the limit of {limit}"
    else:
        message = f"Request body exceeds the limit of {limit} bytes"
    return SIEError(ErrorCode.INPUT_TOO_LONG, message, status=413)


def _body_timeout(timeout_s: float) -> Exception:
    return SIEError(ErrorCode.INVALID_INPUT, f"Request body not received within {timeout_s:g} s", status=408)


async def read_body(
    request: web.Request,
    limit: int,
    *,
    timeout_s: float,
    too_large: Callable[[int, int | None], Exception] = _input_too_long,
    too_slow: Callable[[float], Exception] = _body_timeout,
) -> bytes:
    """The request body, refused beyond ``limit`` bytes before buffering it all: the declared
    Content-Length is checked first, then the bytes as they arrive. The whole body must arrive within
    ``timeout_s`` (a slow client, or one whose Content-Length exceeds what it sends, must not hold the
    connection). ``too_large(limit, declared)`` and ``too_slow(timeout_s)`` build the errors
    (default: 413 INPUT_TOO_LONG, 408 INVALID_INPUT)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    content = request.content
    if content.is_eof():  # the whole body came with the request, as a small one does: nothing to wait for
        body = content.read_nowait()
        if len(body) > limit:
            raise too_large(limit, None)
        return body
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > limit:
                    raise too_large(limit, None)
                chunks.append(chunk)
    except TimeoutError:
        raise too_slow(timeout_s) from None
    return b"".join(chunks)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads_json(body: bytes) -> Any:
    """json.loads for untrusted input: every malformed document (including ones that trip Python's
    recursion or int-size limits, or that decode to data no later step could carry) is a CodecError."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise CodecError("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        raise CodecError(str(exc)) from None
    # a lone surrogate can only come from a \\uD800-\\uDFFF escape: look at the text only then
    check_plain(data, check_text=_SURROGATE_ESCAPE.search(body) is not None)
    return data


def decode_body(body: bytes, content_type: str | None) -> Any:
    if not body:
        raise invalid_input("request body is empty")
    kind = "MessagePack" if wants_msgpack_body(content_type) else "JSON"
    try:
        if kind == "JSON":
            return loads_json(body)
        data = unpackb(body)
        check_plain(data, check_text=False)  # msgpack str is strict UTF-8 already
        return data
    except CodecError as exc:
        raise invalid_input(f"Malformed {kind} body: {exc}") from None


READY_PID_HEADER = "X-SIE-Pid"  # on a gateway's ready /readyz: the process that answered


def base_headers(request_id: str | None = None) -> dict[str, str]:
    headers = {"X-SIE-Server-Version": SERVER_VERSION}
    if request_id:
        headers["X-SIE-Request-ID"] = request_id
    return headers


# Random bytes for request ids, read from the OS 4 KiB at a time: os.urandom releases the GIL, and
# the event loop thread that calls it then queues for the GIL behind the server's inference and
# tokenising threads (measured in sie serve at 32 clients: 2.3% of all its samples on that one line).
_RANDOM_CHUNK = 4096
_random = memoryview(b"")
_random_lock = threading.Lock()


def _reset_random() -> None:
    global _random, _random_lock
    _random = memoryview(b"")  # a forked child must not hand out its parent's ids
    _random_lock = threading.Lock()  # nor wait for a lock some parent thread held at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_random)


def _random_bytes(n: int) -> bytes:
    global _random
    with _random_lock:
        if len(_random) < n:
            _random = memoryview(os.urandom(_RANDOM_CHUNK))
        out, _random = _random[:n], _random[n:]
    return bytes(out)


def new_request_id() -> str:
    """A UUIDv7 (time-ordered) request id, as every front door hands out."""
    ms = int(time.time() * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(_random_bytes(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    h = f"{value:032x}"  # uuid.UUID's own text form, without building the object on every request
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def timing_headers(
    *,
    queue_ms: float,
    tokenization_ms: float,
    inference_ms: float,
    postprocessing_ms: float = 0.0,
    total_ms: float | None = None,
    input_tokens: int | None = None,
) -> dict[str, str]:
    """The timing and usage headers of a successful inference answer (milliseconds, 2 decimals);
    tokenisation and postprocessing only when they took time, usage only when it was counted."""
    headers = {"X-Queue-Time": f"{queue_ms:.2f}", "X-Inference-Time": f"{inference_ms:.2f}"}
    if tokenization_ms > 0:
        headers["X-Tokenization-Time"] = f"{tokenization_ms:.2f}"
    if postprocessing_ms > 0:
        headers["X-Postprocessing-Time"] = f"{postprocessing_ms:.2f}"
    if total_ms is not None:
        headers["X-Total-Time"] = f"{total_ms:.2f}"
    if input_tokens is not None:
        headers["X-SIE-Units-Input-Tokens"] = str(int(input_tokens))
    return headers


def respond(
    request: web.Request, body: dict[str, Any], headers: dict[str, str] | None = None, status: int = 200
) -> web.Response:
    """msgpack or JSON per the Accept header."""
    if wants_msgpack_response(request.headers.get("Accept")):
        return web.Response(
            body=packb(body), status=status, content_type="application/msgpack", headers=headers
        )
    return web.Response(
        body=dumps_json(body), status=status, content_type="application/json", headers=headers
    )


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":"), allow_nan=False).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(exc: SIEError, request_id: str | None = None) -> web.Response:
    headers = {**base_headers(request_id), **exc.headers()}
    return json_response(exc.body(), status=exc.status, headers=headers)


def _openai_code(exc: SIEError) -> str:
    """The ``code`` of an error in the OpenAI envelope (and beside TEI's shape)."""
    code = exc.code
    if code == ErrorCode.MODEL_NOT_FOUND:
        return "model_not_found"
    if code == ErrorCode.INVALID_INPUT:
        return str(exc.extra.get("openai_code", "invalid_request"))
    if code == ErrorCode.QUEUE_FULL:
        return "server_overloaded"
    if code in (ErrorCode.INFERENCE_ERROR, ErrorCode.INTERNAL_ERROR):
        return "inference_error"
    return str(code)


def openai_error_response(exc: SIEError) -> web.Response:
    """OpenAI envelope: ``{"error": {message, type, param, code, ...}}``."""
    body = {
        "message": exc.message,
        "type": "invalid_request_error" if exc.status < 500 else "server_error",
        "param": exc.param,
        "code": _openai_code(exc),
    }
    body.update({k: v for k, v in exc.extra.items() if k != "openai_code"})
    headers = {**base_headers(), **exc.headers()}
    return json_response({"error": body}, status=exc.status, headers=headers)


# Text Embeddings Inference's error types, by our codes (the rest: a 4xx is Validation, a 5xx Backend)
_TEI_ERROR_TYPES: dict[str, str] = {
    ErrorCode.QUEUE_FULL: "Overloaded",
    ErrorCode.RATE_LIMIT: "Overloaded",
    ErrorCode.RESOURCE_EXHAUSTED: "Overloaded",
    ErrorCode.MODEL_LOADING: "Unhealthy",
    ErrorCode.MODEL_NOT_LOADED: "Unhealthy",
    ErrorCode.MODEL_LOAD_FAILED: "Unhealthy",
    ErrorCode.PROVISIONING: "Unhealthy",
    ErrorCode.QUEUE_UNAVAILABLE: "Unhealthy",
    ErrorCode.INPUT_TOO_LONG: "Validation",
}


def tei_error_response(exc: SIEError) -> web.Response:
    """Text Embeddings Inference's error shape, ``{"error": message, "error_type": type}``, with our
    status and ``Retry-After``; ``code`` and ``param`` ride beside them."""
    kind = _TEI_ERROR_TYPES.get(exc.code) or ("Validation" if exc.status < 500 else "Backend")
    body: dict[str, Any] = {"error": exc.message, "error_type": kind, "code": _openai_code(exc)}
    if exc.param:
        body["param"] = exc.param
    headers = {**base_headers(), **exc.headers()}
    return json_response(body, status=exc.status, headers=headers)


def rerank_error_response(exc: SIEError, path: str) -> web.Response:
    """The error of the rerank route at ``path``: TEI's shape on TEI's, the OpenAI envelope on Cohere's."""
    return tei_error_response(exc) if rerank.ROUTES.get(path) == "tei" else openai_error_response(exc)


def error_for_http_exception(exc: web.HTTPException) -> SIEError:
    """The contract error for an aiohttp HTTP error (unknown route, body over aiohttp's limit, ...)."""
    if exc.status == 413:
        code = ErrorCode.INPUT_TOO_LONG
    elif exc.status == 404:
        code = ErrorCode.NOT_FOUND
    else:
        code = ErrorCode.INVALID_INPUT
    return SIEError(code, exc.reason or f"HTTP {exc.status}", status=exc.status)


def unexpected_error(exc: BaseException) -> SIEError:
    """What a request that failed with an unforeseen exception answers: no traceback, only its type."""
    return SIEError(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")


def config_error_detail(error: str, message: str, **extra: Any) -> dict[str, Any]:
    """The config API's error object (its contract names the code ``error``, not ``code``):
    ``{"detail": <this>}`` is what the config service and the gateway's config mirror answer."""
    return {"error": error, "message": message, **extra}


def config_error_response(
    status: int, error: str, message: str, *, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    return json_response(
        {"detail": config_error_detail(error, message, **extra)}, status=status, headers=headers
    )


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization`` header: trimmed, a case-insensitive ``Bearer `` prefix
    dropped (a raw token is accepted too); None when there is none."""
    if not header:
        return None
    value = header.strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    return value or None


# Routes a front door answers without a token: the API's description (and its assets) always, and
# with ``exempt_operational`` (SIE_AUTH_EXEMPT_OPERATIONAL) the status pages a scraper reads.
DOCS_PATHS = frozenset({"/openapi.json", "/docs"})
OPERATIONAL_PATHS = frozenset({"/", "/health", "/metrics"})


def open_without_token(path: str, probes: frozenset[str], exempt_operational: bool) -> bool:
    """Whether ``path`` answers without a bearer token on a front door whose probes are ``probes``
    (the gateway's and ``sie serve``'s rule alike)."""
    if path in probes or path in DOCS_PATHS or path.startswith("/docs/assets/"):
        return True
    return exempt_operational and (path in OPERATIONAL_PATHS or path.startswith("/ws/"))


def token_matches(token: str, candidates: Iterable[str | None]) -> bool:
    """Whether ``token`` equals one of the configured (non-empty) ``candidates``, in constant time
    per candidate (every candidate is compared)."""
    found = False
    for candidate in candidates:
        if candidate:
            found |= hmac.compare_digest(token.encode("utf-8"), candidate.encode("utf-8"))
    return found


async def stream_status(
    request: web.Request,
    frame: Callable[[], dict[str, Any]],
    interval_s: float,
    sockets: set[web.WebSocketResponse],
) -> web.WebSocketResponse:
    """A status WebSocket (``watch()`` in the SDKs): one JSON text frame from ``frame()`` at once, then
    one every ``interval_s`` until the client goes. ``sockets`` holds the open ones, so that a
    shutting-down server can close them (:func:`close_status_sockets`) instead of waiting on them."""
    ws = web.WebSocketResponse(heartbeat=30.0)
    await ws.prepare(request)
    sockets.add(ws)
    try:
        while not ws.closed:
            await ws.send_str(dumps_json({"timestamp": time.time(), **frame()}).decode())
            try:
                msg = await asyncio.wait_for(ws.receive(), timeout=interval_s)
            except TimeoutError:
                continue
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                break
    except (ConnectionResetError, RuntimeError):  # the client went while a frame was being sent
        pass
    finally:
        sockets.discard(ws)
    return ws


async def close_status_sockets(sockets: set[web.WebSocketResponse]) -> None:
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def index_body(kind: str, routes: list[str]) -> dict[str, Any]:
    """``GET /``: what this server is and where to look next."""
    return {"name": "sie-cluster", "type": kind, "version": SERVER_VERSION, "routes": routes}
