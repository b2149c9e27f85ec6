"""The config API over aiohttp: routes, auth, body limit, errors, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from config_service import docs as api_docs
from config_service.forward import RETRY_AFTER_S, WriteForwarder
from config_service.rules import ConfigError
from config_service.service import ConfigService
from config_service.settings import BODY_TIMEOUT_S, MAX_BODY_BYTES
from iokit import openapi
from iokit.http import bearer_token, config_error_detail, loads_json, read_body, token_matches
from protocol.codec import CodecError
from protocol.config_delta import ResolveBody

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVICE_KEY = web.AppKey("config_service", ConfigService)
AUTH_KEY: web.AppKey[Auth] = web.AppKey("config_auth")
LIMIT_KEY = web.AppKey("config_body_limit", int)
BODY_TIMEOUT_KEY = web.AppKey("config_body_timeout", float)
FORWARDER_KEY = web.AppKey("config_forwarder", WriteForwarder)

PUBLIC, READ, EXPORT, WRITE = "public", "read", "export", "write"


@dataclass(frozen=True)
class Auth:
    """The config API's tokens: read, inference (reads except export) and admin (writes). Empty strings count as unset."""

    admin_token: str | None = None
    read_token: str | None = None
    inference_token: str | None = None
    production: bool = False

    @property
    def any_configured(self) -> bool:
        return bool(self.admin_token or self.read_token or self.inference_token)


def json_error(status: int, detail: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"detail": detail}, status=status, headers=headers)


def check_auth(auth: Auth, kind: str, header: str | None) -> web.Response | None:
    """None when allowed, else the 401/403 response."""
    if kind == PUBLIC:
        return None
    if not auth.any_configured:
        if auth.production:
            return json_error(
                403,
                "config service requires SIE_ADMIN_TOKEN or SIE_CONFIG_READ_TOKEN in production",
            )
        return None
    if kind == WRITE and not auth.admin_token:
        return json_error(403, "Write operations require SIE_ADMIN_TOKEN, which is not configured")
    if header is None or not header.strip():
        return json_error(401, "Missing Authorization header")
    token = bearer_token(header) or ""
    if kind == WRITE:
        return (
            None
            if token_matches(token, [auth.admin_token])
            else json_error(403, "Admin token required for config mutations")
        )
    allowed = [auth.admin_token, auth.read_token]
    if kind == READ:
        allowed.append(auth.inference_token)
    if token_matches(token, allowed):
        return None
    return json_error(403, "Invalid token")


def _kind(kind: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        fn.sie_kind = kind  # type: ignore[attr-defined]
        return fn

    return deco


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    resource = request.match_info.route.resource
    route_name = resource.canonical if resource is not None else "unmatched"
    start = time.perf_counter()
    status = 500
    try:
        kind = getattr(handler, "sie_kind", PUBLIC)
        denied = check_auth(request.app[AUTH_KEY], kind, request.headers.get("Authorization"))
        if denied is not None:
            resp: web.StreamResponse = denied
        else:
            try:
                forwarder = request.app.get(FORWARDER_KEY)
                if kind == WRITE and forwarder is not None and forwarder.should_forward(request):
                    resp = await forwarder.forward(request, await read_body_limited(request))
                else:
                    resp = await handler(request)
            except ConfigError as exc:
                retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.code == "not_writer" else None
                resp = json_error(exc.status, exc.detail(), headers=retry)
            except web.HTTPException as exc:
                if exc.status == 405:
                    resp = json_error(
                        405,
                        f"Method {request.method} not allowed on {request.path}",
                        headers={"Allow": exc.headers.get("Allow", "")},
                    )
                else:
                    resp = json_error(exc.status, exc.reason)
            except Exception:
                log.exception("unhandled error on %s %s", request.method, request.path)
                resp = json_error(500, config_error_detail("internal_error", "internal error"))
        status = resp.status
        return resp
    finally:
        if route_name != "/metrics":
            service.metrics.requests.labels(request.method, route_name, str(status)).inc()
            service.metrics.latency.labels(request.method, route_name).observe(time.perf_counter() - start)


def _payload_too_large(limit: int, declared: int | None) -> Exception:
    return ConfigError(413, "payload_too_large", f"request body exceeds {limit} bytes")


def _body_timeout(timeout_s: float) -> Exception:
    return ConfigError(408, "body_timeout", f"request body not received within {timeout_s:g} s")


async def read_body_limited(request: web.Request) -> bytes:
    return await read_body(
        request,
        request.app[LIMIT_KEY],
        timeout_s=request.app[BODY_TIMEOUT_KEY],
        too_large=_payload_too_large,
        too_slow=_body_timeout,
    )


# ---- handlers ------------------------------------------------------------------------------


@_kind(PUBLIC)
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@_kind(PUBLIC)
async def readyz(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body: dict[str, Any] = {
        "writer": service.lock.held,
        "nats_connected": service.publisher.connected if service.publisher else None,
        "router_id": service.router_id,
    }
    try:
        body["epoch"] = await service.epoch()
    except ConfigError as exc:
        return web.json_response({**body, "ready": False, "reason": exc.message}, status=503)
    if service.catalog_error is not None:
        return web.json_response({**body, "ready": False, "reason": service.catalog_error}, status=503)
    return web.json_response({**body, "ready": True})


@_kind(PUBLIC)
async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    service.metrics.nats_connected.set(1 if service.publisher and service.publisher.connected else 0)
    service.metrics.writer.set(1 if service.lock.held else 0)
    resp = web.Response(body=generate_latest(service.metrics.registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


@_kind(WRITE)
async def post_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    await service.check_writable()
    body = await read_body_limited(request)
    status, payload = await service.add_model(body, request.headers.get("Idempotency-Key"))
    return web.json_response(payload, status=status)


@_kind(WRITE)
async def put_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    await service.check_writable()
    body = await read_body_limited(request)
    status, payload = await service.replace_model(
        request.match_info["model_id"], body, request.headers.get("Idempotency-Key")
    )
    return web.json_response(payload, status=status)


@_kind(WRITE)
async def delete_model(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    await service.check_writable()
    return web.json_response(await service.delete_model(request.match_info["model_id"]))


@_kind(READ)
async def list_models(request: web.Request) -> web.Response:
    return web.json_response((await request.app[SERVICE_KEY].state()).models_listing())


@_kind(READ)
async def get_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    if model_id.endswith("/status"):  # no model id ends so (check_model_id)
        raise ConfigError(
            404,
            "model_not_found",
            "rollout status is served by the gateway (it sees the workers' heartbeats): "
            f"GET <gateway>/v1/configs/models/{model_id}",
            model_id=model_id.removesuffix("/status"),
        )
    text = await request.app[SERVICE_KEY].model_yaml(model_id)
    return web.Response(text=text, content_type="application/x-yaml")


@_kind(EXPORT)
async def export(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE_KEY].export())


@_kind(READ)
async def epoch(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE_KEY].epoch_info())


@_kind(READ)
async def list_bundles(request: web.Request) -> web.Response:
    return web.json_response((await request.app[SERVICE_KEY].state()).bundles_listing())


@_kind(READ)
async def get_bundle(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    service.require_catalog()
    bundle_id = request.match_info["bundle_id"]
    bundle = service.bundles.get(bundle_id)
    if bundle is None:
        raise ConfigError(404, "bundle_not_found", f"bundle {bundle_id!r} is not known", bundle_id=bundle_id)
    doc = {
        "name": bundle.name,
        "engine": bundle.engine,
        "priority": bundle.priority,
        "source": "filesystem",
        "adapters": list(bundle.adapters),
    }
    if request.query.get("format") == "json" or "application/json" in request.headers.get("Accept", ""):
        return web.json_response(doc)
    return web.Response(text=yaml.safe_dump(doc, sort_keys=False), content_type="application/x-yaml")


@_kind(READ)
async def resolve(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body = await read_body_limited(request)
    try:
        data = loads_json(body or b"null")
    except CodecError as exc:
        raise ConfigError(400, "parse_error", f"Invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(400, "parse_error", "body must be a JSON object")
    try:
        parsed = ResolveBody.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["loc"] and err["loc"][0] == "model":
            raise ConfigError(400, "missing_field", "'model' is required (a non-empty string)") from None
        raise ConfigError(400, "parse_error", f"Field '{err['loc'][0]}': {err['msg']}") from None
    spec, bundle = parsed.model, parsed.bundle
    if ":/" in spec:
        prefix, spec = spec.split(":/", 1)
        if bundle and bundle != prefix:
            raise ConfigError(400, "invalid_model_spec", "bundle prefix and bundle field disagree")
        bundle = prefix
    state = await service.state()
    entry = state.models.get(spec)
    profile = None
    if entry is None and ":" in spec:
        base, profile = spec.rsplit(":", 1)
        entry = state.models.get(base)
        if entry is not None and profile not in entry.config.profiles:
            entry = None
    if entry is None:
        raise ConfigError(404, "model_not_found", f"model {spec!r} is not configured", model_id=spec)
    if profile is not None:
        mod = entry.config.resolved_profile(profile).adapter_module
        compatible = state.bundles_for_module(mod)
    else:
        compatible = state.affected_bundles(entry.config)
    if bundle is not None and bundle not in compatible:
        raise ConfigError(
            409, "bundle_conflict", f"bundle {bundle!r} cannot serve {spec!r}", compatible_bundles=compatible
        )
    return web.json_response(
        {
            "model": entry.config.sie_id,
            "resolved_bundle": bundle or (compatible[0] if compatible else None),
            "compatible_bundles": compatible,
            "profiles": sorted(entry.config.profiles),
        }
    )


def create_app(
    service: ConfigService,
    auth: Auth,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    forwarder: WriteForwarder | None = None,
) -> web.Application:
    # aiohttp's own limit sits above ours so that our 413 (with a JSON body) is what clients see.
    app = web.Application(middlewares=[middleware], client_max_size=max_body_bytes + 1024)
    app[SERVICE_KEY] = service
    app[AUTH_KEY] = auth
    app[LIMIT_KEY] = max_body_bytes
    app[BODY_TIMEOUT_KEY] = body_timeout_s
    if forwarder is not None:
        app[FORWARDER_KEY] = forwarder
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/configs/models", post_model)
    app.router.add_get("/v1/configs/models", list_models)
    app.router.add_get("/v1/configs/models/{model_id:.+}", get_model)
    app.router.add_put("/v1/configs/models/{model_id:.+}", put_model)
    app.router.add_delete("/v1/configs/models/{model_id:.+}", delete_model)
    app.router.add_get("/v1/configs/export", export)
    app.router.add_get("/v1/configs/epoch", epoch)
    app.router.add_get("/v1/configs/bundles", list_bundles)
    app.router.add_get("/v1/configs/bundles/{bundle_id}", get_bundle)
    app.router.add_post("/v1/configs/resolve", resolve)
    openapi.add_routes(app, api_docs.TITLE, api_docs.build)
    return app
