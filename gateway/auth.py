"""Bearer-token auth: inference tokens, a separate admin token for pool/config writes."""

from __future__ import annotations

from aiohttp import web

from protocol import http
from protocol.errors import ErrorCode, SIEError

PROBES = frozenset({"/healthz", "/readyz"})
OPERATIONAL = frozenset({"/", "/health", "/metrics"})
DOCS = frozenset({"/openapi.json", "/docs"})  # the API's description is open, like the probes
ADMIN_PREFIXES = ("/v1/pools", "/v1/config", "/v1/admin")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def is_admin_route(method: str, path: str) -> bool:
    return method in WRITE_METHODS and any(
        path == p or path.startswith(p + "/") or path.startswith(p) for p in ADMIN_PREFIXES
    )


def check(
    request: web.Request,
    *,
    enabled: bool,
    tokens: list[str],
    admin_token: str | None,
    exempt_operational: bool,
) -> None:
    """Raise SIEError 401/403/500 when the request may not pass."""
    if not enabled:
        return
    path = request.path
    if path in PROBES or path in DOCS or path.startswith("/docs/assets/"):
        return
    if exempt_operational and (path in OPERATIONAL or path.startswith("/ws/")):
        return
    if not tokens and not admin_token:
        raise SIEError(ErrorCode.INTERNAL_ERROR, "Auth is enabled but no tokens are configured", status=500)
    token = http.bearer_token(request.headers.get("Authorization"))
    if token is None:
        raise SIEError(ErrorCode.UNAUTHORIZED, "Missing bearer token")
    is_admin = bool(admin_token) and http.token_matches(token, [admin_token or ""])
    if is_admin_route(request.method, path):
        if is_admin:
            return
        if http.token_matches(token, tokens):
            raise SIEError(ErrorCode.FORBIDDEN, "This route needs the admin token")
        raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")
    if is_admin or http.token_matches(token, tokens):
        return
    raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")
