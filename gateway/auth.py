"""Bearer-token auth: inference tokens, a separate admin token for pool/config writes."""

from __future__ import annotations

import hmac

from aiohttp import web

from protocol.errors import ErrorCode, SIEError

PROBES = frozenset({"/healthz", "/readyz"})
OPERATIONAL = frozenset({"/", "/health", "/metrics"})
ADMIN_PREFIXES = ("/v1/pools", "/v1/config", "/v1/admin")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _matches(token: str, candidates: list[str]) -> bool:
    found = False
    for c in candidates:
        found |= hmac.compare_digest(token.encode(), c.encode())
    return found


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization")
    if not header:
        return None
    value = header.strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    return value or None


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
    if path in PROBES or (exempt_operational and path in OPERATIONAL):
        return
    if not tokens and not admin_token:
        raise SIEError(ErrorCode.INTERNAL_ERROR, "Auth is enabled but no tokens are configured", status=500)
    token = bearer(request)
    if token is None:
        raise SIEError(ErrorCode.UNAUTHORIZED, "Missing bearer token")
    is_admin = bool(admin_token) and _matches(token, [admin_token or ""])
    if is_admin_route(request.method, path):
        if is_admin:
            return
        if _matches(token, tokens):
            raise SIEError(ErrorCode.FORBIDDEN, "This route needs the admin token")
        raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")
    if is_admin or _matches(token, tokens):
        return
    raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")
