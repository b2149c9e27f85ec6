"""``sie serve``: the standalone HTTP API over the model runtime."""

from __future__ import annotations

import getpass
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST

from iokit import openapi
from iokit.http import (
    base_headers,
    close_status_sockets,
    decode_body,
    error_for_http_exception,
    error_response,
    index_body,
    json_response,
    new_request_id,
    openai_error_response,
    read_body,
    rerank_error_response,
    respond,
    stream_status,
    timing_headers,
    unexpected_error,
)
from protocol import SERVER_VERSION, rerank, tracing
from protocol.api import (
    EncodeParams,
    EncodeRequest,
    ExtractRequest,
    Item,
    ScoreParams,
    ScoreRequest,
    TokenizeRequest,
    parse_request,
    truncation_totals,
    usage,
)
from protocol.errors import SIEError, invalid_input
from protocol.logs import bind
from protocol.openai import (
    dense_dimension,
    dimension_options,
    embedding_row,
    embeddings_response,
    models_response,
    parse_embeddings_request,
    resolve_model,
)
from protocol.priority import PRIORITY_HEADER, request_priority
from protocol.weights import UNKNOWN
from worker.runtime import Result, Runtime
from worker.serve import auth
from worker.serve import docs as api_docs
from worker.serve.metrics import ServeMetrics
from worker.serve.result_cache import ResultLRU, encode_cached
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

RUNTIME = web.AppKey("runtime", Runtime)
SETTINGS = web.AppKey("settings", WorkerSettings)
METRICS = web.AppKey("metrics", ServeMetrics)
REQUEST_ID = web.RequestKey("request_id", str)
STATUS_SOCKETS = web.AppKey("status_sockets", set)
RESULT_CACHE: web.AppKey[ResultLRU | None] = web.AppKey("result_cache")
API_KEYS = web.AppKey("api_keys", list)  # SIE_API_KEY, split once
INDEX_ROUTES = [
    "/v1/encode/{model}",
    "/v1/score/{model}",
    "/v1/extract/{model}",
    "/v1/tokenize/{model}",
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/models",
    "/health",
    "/ws/status",
    "/metrics",
    "/readyz",
]


def _timing_headers(result: Result) -> dict[str, str]:
    t = result.timing
    headers = timing_headers(
        queue_ms=t.queue_ms,
        tokenization_ms=t.tokenization_ms,
        inference_ms=t.inference_ms,
        postprocessing_ms=t.postprocessing_ms,
        total_ms=t.total_ms,
        input_tokens=result.input_tokens,
    )
    headers["X-SIE-Served-By"] = "local"
    return headers


def _usage(result: Result) -> dict[str, int]:
    return usage(result.input_tokens, *truncation_totals(result.items))


def _timing_body(result: Result) -> dict[str, Any]:
    body: dict[str, Any] = result.timing.as_dict()
    if not body["postprocessing_ms"]:
        body["postprocessing_ms"] = None
    return body


def _check_machine_profile(request: web.Request, settings: WorkerSettings) -> None:
    requested = request.headers.get("X-SIE-MACHINE-PROFILE")
    if requested and settings.machine_profile and requested.lower() != settings.machine_profile.lower():
        raise invalid_input(
            f"This worker serves machine profile '{settings.machine_profile}', not '{requested}'",
            requested_profile=requested,
            worker_identity=settings.machine_profile,
        )


async def _decoded(request: web.Request) -> Any:
    settings = request.app[SETTINGS]
    body = await read_body(
        request, settings.max_request_body_bytes, timeout_s=settings.request_body_timeout_s
    )
    return decode_body(body, request.headers.get("Content-Type"))


def _priority(request: web.Request) -> str:
    """The request's priority class: ``X-SIE-Priority``, else ``SIE_SERVE_DEFAULT_PRIORITY`` (serve
    has no tokens, so no token default); a bad header value is a 400 INVALID_INPUT, as on the gateway."""
    return request_priority(
        request.headers.get(PRIORITY_HEADER), None, request.app[SETTINGS].serve_default_priority
    )


def _check_count(items: Sequence[Item], settings: WorkerSettings) -> None:
    if len(items) > settings.max_items_per_request:
        raise invalid_input(
            f"Too many items: {len(items)} (at most {settings.max_items_per_request}); "
            f"split the request into batches of {settings.max_items_per_request} or fewer",
            param="items",
        )


async def encode(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    settings = request.app[SETTINGS]
    _check_machine_profile(request, settings)
    req = parse_request(EncodeRequest, await _decoded(request))
    _check_count(req.items, settings)
    priority = _priority(request)
    cache = request.app[RESULT_CACHE]
    hits = 0
    if cache is not None and _cache_wanted(request):
        result, hits = await encode_cached(
            request.app[RUNTIME], cache, model, req.items, req.params, priority=priority
        )
        request.app[METRICS].cache_lookups.labels("hit").inc(hits)
        request.app[METRICS].cache_lookups.labels("miss").inc(len(req.items) - hits)
    else:
        result = await request.app[RUNTIME].encode(model, req.items, req.params, priority=priority)
    body = {"model": model, "items": result.items, "timing": _timing_body(result), "usage": _usage(result)}
    headers = {**base_headers(request[REQUEST_ID]), **_timing_headers(result), "X-SIE-Cache-Hits": str(hits)}
    return respond(request, body, headers)


def _cache_wanted(request: web.Request) -> bool:
    value = (request.headers.get("X-SIE-Cache") or "on").strip().lower()
    if value not in ("on", "off"):
        raise invalid_input(f"X-SIE-Cache must be 'on' or 'off', got {value!r}", param="X-SIE-Cache")
    return value == "on"


async def score(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    settings = request.app[SETTINGS]
    _check_machine_profile(request, settings)
    req = parse_request(ScoreRequest, await _decoded(request))
    result = await request.app[RUNTIME].score(
        model, req.query, req.items, req.params, priority=_priority(request)
    )
    body = {
        "model": model,
        "query_id": result.query_id,
        "scores": result.items,
        "timing": _timing_body(result),
        "usage": _usage(result),
    }
    return respond(request, body, {**base_headers(request[REQUEST_ID]), **_timing_headers(result)})


async def extract(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    settings = request.app[SETTINGS]
    _check_machine_profile(request, settings)
    req = parse_request(ExtractRequest, await _decoded(request))
    _check_count(req.items, settings)
    result = await request.app[RUNTIME].extract(model, req.items, req.params, priority=_priority(request))
    body = {"model": model, "items": result.items, "timing": _timing_body(result), "usage": _usage(result)}
    return respond(request, body, {**base_headers(request[REQUEST_ID]), **_timing_headers(result)})


async def tokenize(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    settings = request.app[SETTINGS]
    _check_machine_profile(request, settings)
    req = parse_request(TokenizeRequest, await _decoded(request))
    _check_count(req.items, settings)
    _priority(request)  # checked as on the gateway; tokenizing runs no forward pass, so nothing waits
    result = await request.app[RUNTIME].tokenize(model, req.items, req.params)
    body = {
        "model": model,
        "items": result.items,
        "timing": _timing_body(result),
        "usage": {"input_tokens": result.input_tokens},
    }
    return respond(request, body, {**base_headers(request[REQUEST_ID]), **_timing_headers(result)})


def _entries(runtime: Runtime) -> list[dict[str, Any]]:
    out = []
    weights = runtime.weights_status()
    for config, profile in runtime.catalog.routable_names():
        state, err = runtime.model_state(config.sie_id, profile)
        entry = runtime.catalog.model_entry(
            config, profile, loaded=state == "loaded", state=state, last_error=err
        )
        out.append(  # beside the contract's fields
            {
                **entry,
                "weights": weights.get(config.sie_id, UNKNOWN),
                "precision": runtime.loaded_precision(config.sie_id, profile),
            }
        )
    return out


async def list_models(request: web.Request) -> web.Response:
    return json_response(models_response(_entries(request.app[RUNTIME])), headers=base_headers())


async def get_model(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    spec = request.match_info["model"]
    config, profile = runtime.catalog.split_spec(spec)
    state, err = runtime.model_state(config.sie_id, profile or "default")
    entry = runtime.catalog.model_entry(
        config, profile, loaded=state == "loaded", state=state, last_error=err
    )
    entry["weights"] = runtime.weights_status().get(config.sie_id, UNKNOWN)
    entry["precision"] = runtime.loaded_precision(config.sie_id, profile or "default")
    return json_response(entry, headers=base_headers())


async def health(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    settings = request.app[SETTINGS]
    return json_response(
        {
            "type": "worker",
            "status": "healthy" if runtime.ready else "starting",
            "version": SERVER_VERSION,
            "machine_profile": settings.machine_profile or None,
            "bundle": settings.bundle,
            "device": runtime.device,
            "loaded_models": runtime.loaded_models(),
            "loading_models": runtime.loading_models(),
            "queue_depth": runtime.queue_depth(),
            "uptime_seconds": round(time.time() - runtime.started_at, 1),
            "pid": os.getpid(),
        }
    )


def status_frame(runtime: Runtime, settings: WorkerSettings) -> dict[str, Any]:
    """One ``/ws/status`` frame (what the SDK's ``watch()`` shows for a worker)."""
    used, total = runtime.memory_usage()
    on_cuda = runtime.device.startswith("cuda")
    loaded = runtime.loaded_models()
    return {
        "ready": runtime.ready,
        "name": settings.worker_id,
        "machine_profile": settings.machine_profile or runtime.device,
        "pool_name": settings.pool,
        "gpu_count": 1 if on_cuda else 0,
        "bundle": settings.bundle,
        "bundle_config_hash": runtime.bundle_config_hash(pool=settings.pool),
        "loaded_models": loaded,
        "loading_models": runtime.loading_models(),
        "max_batch_requests": settings.max_batch_requests,
        "queue_depth": runtime.queue_depth(),
        "saturated": runtime.queue_depth() >= settings.max_batch_requests,
        "server": {
            "version": SERVER_VERSION,
            "uptime_seconds": round(time.time() - runtime.started_at, 1),
            "user": getpass.getuser(),
            "working_dir": os.getcwd(),
            "pid": os.getpid(),
        },
        "gpus": [{"device": runtime.device, "memory_used_bytes": used, "memory_total_bytes": total}]
        if on_cuda
        else [],
        "models": [{"name": name, "state": "loaded"} for name in loaded],
    }


async def ws_status(request: web.Request) -> web.WebSocketResponse:
    runtime, settings = request.app[RUNTIME], request.app[SETTINGS]
    return await stream_status(
        request, lambda: status_frame(runtime, settings), 0.2, request.app[STATUS_SOCKETS]
    )


async def index(request: web.Request) -> web.Response:
    return json_response(index_body("worker", INDEX_ROUTES))


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def readyz(request: web.Request) -> web.Response:
    if request.app[RUNTIME].ready:
        return web.Response(text="ok")
    return web.Response(text="not ready", status=503)


async def metrics(request: web.Request) -> web.Response:
    data = request.app[METRICS].render(request.app[RUNTIME])
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openai_embeddings(request: web.Request) -> web.Response:
    """OpenAI-compatible embeddings; errors use the OpenAI envelope."""
    runtime = request.app[RUNTIME]
    try:
        req = parse_embeddings_request(
            await _decoded(request), max_inputs=request.app[SETTINGS].max_items_per_request
        )
        resolved = resolve_model(runtime.catalog.resolve, req.model)
        options = dimension_options(req.dimensions, dense_dimension(resolved, req.model))
        result = await runtime.encode(
            req.model,
            [Item(text=t) for t in req.inputs],
            EncodeParams(output_types=["dense"], output_dtype="float32", options=options),
            priority=_priority(request),
        )
    except SIEError as exc:
        return openai_error_response(exc)
    rows = [
        embedding_row(item["dense"]["values"], i, req.encoding_format) for i, item in enumerate(result.items)
    ]
    body = embeddings_response(req.model, rows, req.inputs, int(result.input_tokens))
    return json_response(body, headers=base_headers(request[REQUEST_ID]))


async def rerank_route(request: web.Request) -> web.Response:
    """Cohere's ``/v1/rerank``, ``/v2/rerank`` and TEI's ``/rerank``, answered by ``score``."""
    runtime, settings = request.app[RUNTIME], request.app[SETTINGS]
    try:
        call = rerank.parse(
            request.path, await _decoded(request), default_model=settings.rerank_default_model
        )
        try:
            result = await runtime.score(
                call.model,
                call.query_item(),
                call.score_items(),
                ScoreParams(options=call.options),
                priority=_priority(request),
            )
        except SIEError as exc:
            raise rerank.in_request_terms(exc, call.kind) from None
    except SIEError as exc:
        return rerank_error_response(exc, request.path)
    ranked = rerank.ranking(result.items, len(call.texts))
    body = rerank.answer(call, ranked, request[REQUEST_ID], result.input_tokens)
    return json_response(body, headers=base_headers(request[REQUEST_ID]))


def _error_in_route_shape(request: web.Request, exc: SIEError) -> web.Response:
    """An error raised before the handler (a refused key) in the envelope its route answers errors in."""
    if request.path == "/v1/embeddings":
        return openai_error_response(exc)
    if request.path in rerank.ROUTES:
        return rerank_error_response(exc, request.path)
    return error_response(exc, request[REQUEST_ID])


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[REQUEST_ID] = new_request_id()
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
    metrics_ = request.app[METRICS]
    started = time.monotonic()
    try:
        with (
            bind(
                request_id=request[REQUEST_ID],
                trace_id=tracing.trace_id_of(request.headers.get("traceparent")),
            ),
            tracing.span(
                "serve.request",
                parent=request.headers.get("traceparent"),
                parent_state=request.headers.get("tracestate"),
                attributes={"endpoint": endpoint},
            ),
        ):
            auth.check(request, request.app[API_KEYS], request.app[SETTINGS].auth_exempt_operational)
            response = await handler(request)
    except SIEError as exc:
        response = _error_in_route_shape(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(error_for_http_exception(exc), request[REQUEST_ID])
    except Exception as exc:
        log.exception("unhandled error on %s", request.path)
        response = error_response(unexpected_error(exc), request[REQUEST_ID])
    metrics_.requests.labels(endpoint, str(response.status)).inc()
    metrics_.latency.labels(endpoint).observe(time.monotonic() - started)
    return response


def create_app(runtime: Runtime, settings: WorkerSettings | None = None) -> web.Application:
    """The aiohttp application over ``runtime``; the runtime's start/close follow the app's."""
    settings = settings or runtime.settings
    app = web.Application(middlewares=[error_middleware], client_max_size=settings.max_request_body_bytes + 1)
    app[RUNTIME] = runtime
    app[SETTINGS] = settings
    app[METRICS] = ServeMetrics()
    app[STATUS_SOCKETS] = set()
    app[API_KEYS] = settings.api_keys()
    app[RESULT_CACHE] = (
        ResultLRU(settings.serve_result_cache_items, settings.serve_result_cache_ttl_s)
        if settings.serve_result_cache_items else None
    )  # fmt: skip
    app.router.add_post("/v1/encode/{model:.+}", encode)
    app.router.add_post("/v1/score/{model:.+}", score)
    app.router.add_post("/v1/extract/{model:.+}", extract)
    app.router.add_post("/v1/tokenize/{model:.+}", tokenize)
    app.router.add_post("/v1/embeddings", openai_embeddings)
    for path in rerank.ROUTES:
        app.router.add_post(path, rerank_route)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/", index)
    app.router.add_get("/health", health)
    app.router.add_get("/ws/status", ws_status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    openapi.add_routes(app, api_docs.TITLE, api_docs.build)

    async def _start(app: web.Application) -> None:
        await runtime.start()

    async def _stop(app: web.Application) -> None:
        await runtime.close()

    async def _close_sockets(app: web.Application) -> None:
        await close_status_sockets(app[STATUS_SOCKETS])

    app.on_startup.append(_start)
    app.on_shutdown.append(_close_sockets)
    app.on_cleanup.append(_stop)
    return app
