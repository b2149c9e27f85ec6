"""``sie serve --api-key``: bearer keys on every route but the probes and the API's description.

As Text Embeddings Inference's and vLLM's ``--api-key``: with one or more keys set (SIE_API_KEY,
comma-separated), a request needs ``Authorization: Bearer <key>``. Missing or wrong: 401
UNAUTHORIZED. The probes (``/healthz``, ``/livez``, ``/readyz``) stay open for the orchestrator,
and so do ``/openapi.json`` and ``/docs``, as on the gateway. ``/``, ``/health``, ``/metrics`` and
``/ws/status`` need the key too unless SIE_AUTH_EXEMPT_OPERATIONAL is true (the gateway's rule,
iokit.http.open_without_token).
The comparison is constant-time (iokit.http.token_matches); the keys are never logged.
"""

from __future__ import annotations

from aiohttp import web

from iokit import http
from protocol.errors import ErrorCode, SIEError

PROBES = frozenset({"/healthz", "/livez", "/readyz"})


def check(request: web.Request, keys: list[str], exempt_operational: bool) -> None:
    """Raise SIEError 401 UNAUTHORIZED when ``keys`` are set and the request carries none of them."""
    if not keys or http.open_without_token(request.path, PROBES, exempt_operational):
        return
    token = http.bearer_token(request.headers.get("Authorization"))
    if token is None:
        raise SIEError(ErrorCode.UNAUTHORIZED, "Missing bearer token: send Authorization: Bearer <api key>")
    if not http.token_matches(token, keys):
        raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")
