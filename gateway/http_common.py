"""What every gateway handler shares: reading bodies, success headers, content negotiation, error
and provisioning responses.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway import responses
from gateway.lanes import Provisioning
from gateway.parts import METRICS_KEY, SETTINGS_KEY
from gateway.result_cache import CACHE_WORKER_ID
from iokit import http
from protocol import SERVER_VERSION
from protocol.codec import CodecError, wants_msgpack_response
from protocol.errors import SIEError, format_retry_after, invalid_input
from protocol.work import WorkResult


def sdk_understands_503(request: web.Request) -> bool:
    """sie-sdk 0.7+ fails on a 202; older SDKs and non-SDK clients get the documented 202."""
    value = request.headers.get("X-SIE-SDK-Version")
    if value is None:
        return False
    try:
        parts = [int(p) for p in value.strip().split(".")[:2]]
    except ValueError:
        return True  # an SDK that could not read its own version ("unknown") is a modern one
    major, minor = (parts + [0, 0])[:2]
    return (major, minor) >= (0, 7)


def error_response(err: SIEError, *, openai: bool = False) -> web.Response:
    """The native ``{"detail": ...}`` envelope, or the OpenAI one on the embeddings route."""
    return http.openai_error_response(err) if openai else http.error_response(err)


async def read_body(request: web.Request) -> Any:
    """The decoded body (msgpack or JSON per Content-Type): 413 beyond the size limit, 408 when it does not
    arrive within the body timeout, 400 when it does not decode."""
    settings = request.app[SETTINGS_KEY]
    raw = await http.read_body(
        request, settings.gateway_max_body_bytes, timeout_s=settings.gateway_body_timeout_s
    )
    return http.decode_body(raw, request.headers.get("Content-Type"))


async def read_json_body(request: web.Request, what: str) -> Any:
    """A JSON body (None when empty), within the body's size and time limits; 400 naming ``what``
    when it is not JSON."""
    settings = request.app[SETTINGS_KEY]
    raw = await http.read_body(
        request, settings.gateway_max_body_bytes, timeout_s=settings.gateway_body_timeout_s
    )
    try:
        return http.loads_json(raw) if raw else None
    except CodecError:
        raise invalid_input(f"{what} must be JSON") from None


def success_headers(
    request_id: str, results: list[WorkResult], wait_ms: float, t: dict[str, float] | None = None
) -> dict[str, str]:
    """The headers of an answer: ids, versions, and the stage times of ``t`` (the answer's
    :func:`responses.timing`, computed here when the caller has not)."""
    h = {
        "X-SIE-Server-Version": SERVER_VERSION,
        "X-SIE-Version": SERVER_VERSION,
        "X-SIE-Request-ID": request_id,
        "X-SIE-Worker": f"queue:{request_id}",
        "X-Queue-Wait-Time": f"{wait_ms:.1f}",
        "X-SIE-Cache-Hits": str(sum(1 for r in results if r.worker_id == CACHE_WORKER_ID)),
    }
    if t is None:
        t = responses.timing(results, wait_ms)
    h.update(
        http.timing_headers(
            queue_ms=t["queue_ms"],
            tokenization_ms=t["tokenization_ms"],
            inference_ms=t["inference_ms"],
            postprocessing_ms=t.get("postprocessing_ms", 0.0),
            input_tokens=responses.input_tokens(results),
        )
    )
    return h


def respond(request: web.Request, msgpack_body: Any, json_body: Any, headers: dict[str, str]) -> web.Response:
    if wants_msgpack_response(request.headers.get("Accept")):
        return web.Response(body=msgpack_body(), content_type="application/msgpack", headers=headers)
    return web.json_response(json_body(), headers=headers)


def provisioning_response(request: web.Request, p: Provisioning, *, force_503: bool = False) -> web.Response:
    request.app[METRICS_KEY].provisioning.labels(p.machine_profile or "any").inc()
    if force_503 or sdk_understands_503(request):
        return error_response(p, openai=force_503)
    body = {
        "status": "provisioning",
        "gpu": p.machine_profile,
        "bundle": p.bundle,
        "pool": p.pool,
        "estimated_wait_s": 180,
        "message": p.message,
    }
    return web.json_response(
        body, status=202, headers={"Retry-After": format_retry_after(p.retry_after or 0)}
    )
