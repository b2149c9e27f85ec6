"""HTTP plumbing shared by every front door (worker serve, gateway): body limits, decoding, responses."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from aiohttp import web

from protocol import SERVER_VERSION
from protocol.codec import (
    CodecError,
    check_plain,
    packb,
    to_jsonable,
    unpackb,
    wants_msgpack_body,
    wants_msgpack_response,
)
from protocol.errors import ErrorCode, SIEError, invalid_input


class BodyTooLarge(Exception):
    """The body is larger than the limit (declared or as sent)."""


class BodyTimeout(Exception):
    """The client did not send the whole body in time (e.g. Content-Length larger than what it sends)."""


async def read_raw_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The request body, at most ``limit`` bytes (checked before buffering it all), received within
    ``timeout_s``: a slow or lying client must not hold a connection. Raises BodyTooLarge / BodyTimeout;
    each front door turns them into its own envelope."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit}")
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"Request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"Request body not received within {timeout_s:g} s") from None
    return b"".join(chunks)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """read_raw_body with the contract's errors: 413 INPUT_TOO_LONG, 408 INVALID_INPUT."""
    try:
        return await read_raw_body(request, limit, timeout_s)
    except BodyTooLarge as exc:
        raise SIEError(ErrorCode.INPUT_TOO_LONG, str(exc), status=413) from None
    except BodyTimeout as exc:
        raise SIEError(ErrorCode.INVALID_INPUT, str(exc), status=408) from None


def loads_json(body: bytes | str) -> Any:
    """json.loads for untrusted input: every malformed document (including ones that trip Python's
    recursion or int-size limits, or that decode to data no later step could carry) is a CodecError."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise CodecError(str(exc) if not isinstance(exc, RecursionError) else "nested too deeply") from None
    check_plain(data)
    return data


def decode_body(body: bytes, content_type: str | None) -> Any:
    if not body:
        raise invalid_input("request body is empty")
    kind = "MessagePack" if wants_msgpack_body(content_type) else "JSON"
    try:
        if kind == "JSON":
            return loads_json(body)
        data = unpackb(body)
        check_plain(data)
        return data
    except CodecError as exc:
        raise invalid_input(f"Malformed {kind} body: {exc}") from None


def base_headers(request_id: str | None = None) -> dict[str, str]:
    headers = {"X-SIE-Server-Version": SERVER_VERSION}
    if request_id:
        headers["X-SIE-Request-ID"] = request_id
    return headers


def new_request_id() -> str:
    return uuid.uuid4().hex


def respond(
    request: web.Request, body: dict[str, Any], headers: dict[str, str] | None = None, status: int = 200
) -> web.Response:
    """msgpack or JSON per the Accept header (contract 1.3)."""
    if wants_msgpack_response(request.headers.get("Accept")):
        return web.Response(
            body=packb(body), status=status, content_type="application/msgpack", headers=headers
        )
    return json_response(to_jsonable(body), status=status, headers=headers)


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


def openai_error_response(exc: SIEError) -> web.Response:
    """OpenAI envelope: ``{"error": {message, type, param, code, ...}}`` (contract 7)."""
    code = exc.code
    if code == ErrorCode.MODEL_NOT_FOUND:
        code = "model_not_found"
    elif code == ErrorCode.INVALID_INPUT:
        code = exc.extra.get("openai_code", "invalid_request")
    elif code == ErrorCode.QUEUE_FULL:
        code = "server_overloaded"
    elif code in (ErrorCode.INFERENCE_ERROR, ErrorCode.INTERNAL_ERROR):
        code = "inference_error"
    body = {
        "message": exc.message,
        "type": "invalid_request_error" if exc.status < 500 else "server_error",
        "param": exc.param,
        "code": code,
    }
    body.update({k: v for k, v in exc.extra.items() if k != "openai_code"})
    headers = {**base_headers(), **exc.headers()}
    return json_response({"error": body}, status=exc.status, headers=headers)
