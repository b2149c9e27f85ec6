"""Bearer-token auth: inference tokens, a separate admin token for pool/config writes.

Admin routes are closed in every auth mode until an admin token is configured (SIE_ADMIN_TOKEN):
an open gateway on a laptop still must not let anyone who reaches it create or delete pools."""

from __future__ import annotations

from aiohttp import web

from iokit import http
from protocol.errors import ErrorCode, SIEError

PROBES = frozenset({"/healthz", "/readyz"})
ADMIN_PREFIXES = ("/v1/pools", "/v1/config", "/v1/admin")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def is_admin_route(method: str, path: str) -> bool:
    return method in WRITE_METHODS and any(
        path == p or path.startswith(p + "/") or path.startswith(p) for p in ADMIN_PREFIXES
    )


NO_ADMIN_TOKEN = (
    "Pool and admin writes are off on this gateway: set SIE_ADMIN_TOKEN on it "
    "and send that token as the bearer token"
)


def check_admin(request: web.Request, *, tokens: list[str], admin_token: str | None) -> None:
    """An admin route (pool create/renew/delete, config and admin writes) in every auth mode, ``none``
    included: 403 FORBIDDEN while no admin token is configured, else the admin token is needed
    (401 without a token or with an unknown one, 403 with an inference token)."""
    if not admin_token:
        raise SIEError(ErrorCode.FORBIDDEN, NO_ADMIN_TOKEN)
    token = http.bearer_token(request.headers.get("Authorization"))
    if token is None:
        raise SIEError(ErrorCode.UNAUTHORIZED, "Missing bearer token: this route needs the admin token")
    if http.token_matches(token, [admin_token]):
        return
    if http.token_matches(token, tokens):
        raise SIEError(ErrorCode.FORBIDDEN, "This route needs the admin token")
    raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")


def check(
    request: web.Request,
    *,
    enabled: bool,
    tokens: list[str],
    admin_token: str | None,
    exempt_operational: bool,
) -> None:
    """Raise SIEError 401/403/500 when the request may not pass. Admin routes need the admin token
    whether auth is enabled or not (check_admin); the rest only when it is."""
    path = request.path
    if is_admin_route(request.method, path):
        check_admin(request, tokens=tokens, admin_token=admin_token)
        return
    if not enabled or http.open_without_token(path, PROBES, exempt_operational):
        return
    if not tokens and not admin_token:
        raise SIEError(ErrorCode.INTERNAL_ERROR, "Auth is enabled but no tokens are configured", status=500)
    token = http.bearer_token(request.headers.get("Authorization"))
    if token is None:
        raise SIEError(ErrorCode.UNAUTHORIZED, "Missing bearer token")
    if http.token_matches(token, [admin_token, *tokens]):
        return
    raise SIEError(ErrorCode.UNAUTHORIZED, "Invalid bearer token")
