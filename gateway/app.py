"""The gateway's HTTP application: same public API as ``sie serve``, served through NATS JetStream.

``create_app(settings, nc, registry)`` builds an aiohttp app around a :class:`Gateway`, which holds
the per-process state (dispatcher, worker registry, pools, demand, metrics) and its NATS tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import nats.errors
import nats.js.errors
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import auth, responses
from gateway.dispatch import Dispatcher, Lane, new_request_id
from gateway.dlq import DLQForwarder
from gateway.metrics import DemandTracker, GatewayMetrics
from gateway.pools import DEFAULT_POOL, PoolStore, normalize_pool_name
from gateway.registry import ModelRegistry, Route
from gateway.settings import GatewaySettings
from gateway.workers import WorkerRegistry, WorkerState
from protocol import SERVER_VERSION, http
from protocol import params as rp
from protocol.api import EncodeRequest, ExtractRequest, ScoreRequest, parse_request
from protocol.catalog import supported_outputs
from protocol.codec import unpackb, wants_msgpack_response
from protocol.errors import ErrorCode, SIEError, format_retry_after, invalid_input
from protocol.streams import dlq_stream_config
from protocol.subjects import HEALTH_PREFIX
from protocol.work import WorkItem, WorkResult

log = logging.getLogger(__name__)

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
REQUEST_ID_KEY = web.RequestKey("sie_request_id", str)


class Provisioning(Exception):
    """No healthy worker can serve the lane yet (scale from zero, or a pool still pending)."""

    def __init__(self, machine_profile: str | None, bundle: str, pool: str, message: str) -> None:
        super().__init__(message)
        self.machine_profile = machine_profile
        self.bundle = bundle
        self.pool = pool
        self.message = message


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


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        nc: NATS,
        registry: ModelRegistry,
        *,
        router_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.registry = registry
        self.metrics = GatewayMetrics()
        self.demand = DemandTracker(self.metrics, settings.gateway_demand_expiry_s)
        self.workers = WorkerRegistry(settings.gateway_worker_stale_s)
        self.dispatcher = Dispatcher(
            nc,
            metrics=self.metrics,
            storage=settings.stream_storage,
            max_age_s=settings.stream_max_age_s,
            max_msgs=settings.stream_max_msgs,
            replicas=settings.stream_replicas,
            max_stream_pending=settings.gateway_max_stream_pending,
            publish_concurrency=settings.gateway_publish_concurrency,
            publish_timeout_s=settings.gateway_publish_timeout_s,
            queue_full_retry_after_s=settings.gateway_queue_full_retry_after_s,
            router_id=router_id,
        )
        self.pools: PoolStore | None = None
        self.dlq = DLQForwarder(nc, self.dispatcher, self.metrics)
        self._subs: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self.started_at = time.time()

    @property
    def router_id(self) -> str:
        return self.dispatcher.router_id

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        js = self.nc.jetstream()
        await self.dispatcher.start()
        self._subs.append(await self.nc.subscribe(HEALTH_PREFIX + ".>", cb=self._on_heartbeat))
        self.heartbeats_since = time.monotonic()
        try:
            await js.add_stream(StreamConfig(**dlq_stream_config(storage=self.settings.stream_storage)))
        except Exception as exc:  # exists with other settings, or JetStream busy: forwarding still works
            log.info("DEAD_LETTERS stream not (re)created: %s", exc)
        await self.dlq.start()
        self.pools = await PoolStore.open(
            js,
            self.settings.pool_bucket,
            self.workers,
            storage=self.settings.stream_storage,
            default_ttl_s=self.settings.pool_ttl_s,
            max_ttl_s=self.settings.pool_max_ttl_s,
            max_pools=self.settings.pool_max_count,
            known_profiles=self.known_profiles,
            known_bundles=self.registry.bundle_names,
            check_model=lambda m: self.registry.resolve(m),
            on_event=lambda e: self.metrics.pool_events.labels(e).inc(),
        )
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        await self.registry.start(self.nc, self.metrics)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        with contextlib.suppress(Exception):
            await self.registry.stop()
        await self.dlq.stop()
        await self.dispatcher.stop()

    def on_reconnect(self) -> None:
        self.dispatcher.on_reconnect()

    async def _housekeeping(self) -> None:
        last_sweep = 0.0
        while True:
            await asyncio.sleep(1.0)
            try:
                self.workers.prune()
                self.demand.refresh(self.lane_served)
                now = time.monotonic()
                if self.pools is not None and now - last_sweep >= self.settings.pool_sweep_interval_s:
                    last_sweep = now
                    await self.pools.sweep()
            except Exception as exc:
                log.warning("housekeeping failed: %s", exc)

    async def _on_heartbeat(self, msg) -> None:
        worker_id = msg.subject[len(HEALTH_PREFIX) + 1 :]
        self.workers.observe(worker_id, msg.data)

    # ---- routing ---------------------------------------------------------------------------
    def known_profiles(self) -> list[str]:
        return sorted(set(self.settings.configured_gpus()) | set(self.workers.live_profiles()))

    def lane_served(self, machine_profile: str, bundle: str) -> bool:
        """True when a healthy worker serves ``(machine_profile, bundle)`` ("any"/"" = any profile)."""
        for w in self.workers.healthy():
            if w.bundle == bundle and (machine_profile in ("", "any") or w.profile == machine_profile):
                return True
        return False

    def canonical_profile(self, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        profile = value.strip().lower()
        configured = self.settings.configured_gpus()
        if not configured:
            return profile
        if profile in configured:
            return profile
        if f"{profile}-spot" in configured:
            return f"{profile}-spot"
        if profile in self.workers.live_profiles():
            return profile
        raise invalid_input(
            f"Machine profile '{value}' is not configured. Configured profiles: {configured}",
            param="X-SIE-MACHINE-PROFILE",
            configured_gpu_types=configured,
        )

    def routing_headers(self, request: web.Request) -> tuple[str | None, str | None]:
        profile = request.headers.get("X-SIE-MACHINE-PROFILE") or None
        pool = request.headers.get("X-SIE-Pool") or None
        if profile and "/" in profile:
            head, _, tail = profile.partition("/")
            pool = pool or head or None
            profile = tail or None
        return (normalize_pool_name(pool) if pool else None), self.canonical_profile(profile)

    async def choose_lane(self, route: Route, pool_name: str | None, profile: str | None) -> Lane:
        queue_pool = DEFAULT_POOL
        assigned_ids: set[str] | None = None
        pool_state = "active"
        if pool_name and pool_name != DEFAULT_POOL:
            spec = await self.pools.lookup(pool_name) if self.pools else None
            if spec is None:
                if any(w.pool == pool_name for w in self.workers.healthy()):
                    queue_pool = pool_name  # a physical queue pool with live workers
                else:
                    raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{pool_name}' not found", param="X-SIE-Pool")
            else:
                queue_pool = spec.get("queue_pool") or DEFAULT_POOL
                if spec.get("bundle") and spec["bundle"] not in [b.lower() for b in route.bundles]:
                    raise invalid_input(
                        f"Pool '{pool_name}' serves bundle '{spec['bundle']}', which cannot run '{route.model_id}'"
                    )
                assigned = self.pools.assigned(spec)  # type: ignore[union-attr]
                pool_state = self.pools.state(spec, assigned)  # type: ignore[union-attr]
                assigned_ids = {w.worker_id for w in assigned}
        candidates = self.workers.select(
            pool=queue_pool, profile=profile, bundles=route.bundles, model_id=route.model_id
        )
        if assigned_ids is not None:
            candidates = [w for w in candidates if w.worker_id in assigned_ids]
        if not candidates or pool_state != "active":
            bundle = route.bundles[0]
            self.demand.record(profile or "any", bundle)
            where = f"pool '{pool_name}'" if pool_name else "the cluster"
            what = f"machine profile '{profile}'" if profile else "any machine profile"
            raise Provisioning(
                profile,
                bundle,
                queue_pool,
                f"No ready worker for model '{route.model_id}' on {what} in {where}; capacity is being provisioned",
            )
        return self._best_lane(route, queue_pool, candidates)

    def _best_lane(self, route: Route, pool: str, candidates: list[WorkerState]) -> Lane:
        order = {b.lower(): i for i, b in enumerate(route.bundles)}
        lanes: dict[tuple[str, str], list[WorkerState]] = {}
        for w in candidates:
            lanes.setdefault((w.profile, w.bundle), []).append(w)

        def score(item: tuple[tuple[str, str], list[WorkerState]]) -> tuple:
            (profile, bundle), ws = item
            loaded = any(w.has_loaded(route.model_id) for w in ws)
            depth = sum(w.heartbeat.queue_depth for w in ws) / len(ws)
            return (not loaded, order.get(bundle, 99), depth, profile, bundle)

        (profile, bundle), _ = min(lanes.items(), key=score)
        return Lane(pool, profile, bundle)

    # ---- running a request -----------------------------------------------------------------
    async def execute(
        self,
        request: web.Request,
        route: Route,
        operation: str,
        build: Any,
        n_items: int,
    ) -> tuple[str, list[WorkResult], float, Lane]:
        """Route, publish and collect. ``build(lane, request_id, reply, deadline_ts)`` → list[WorkItem]."""
        pool_name, profile = self.routing_headers(request)
        if not self.nc.is_connected:
            raise SIEError(
                ErrorCode.QUEUE_UNAVAILABLE, "Work queue is not connected; retry later", retry_after=2
            )
        lane = await self.choose_lane(route, pool_name, profile)
        try:
            await self.dispatcher.ensure_stream(lane.pool)
            await self.dispatcher.check_capacity(lane.pool, n_items)
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            raise SIEError(
                ErrorCode.QUEUE_UNAVAILABLE,
                f"Work queue unavailable ({type(exc).__name__}); retry later",
                retry_after=2,
            ) from None
        request_id = new_request_id()
        request[REQUEST_ID_KEY] = request_id
        timeout = self.settings.gateway_request_timeout_s
        items = build(lane, request_id, self.dispatcher.reply_subject(request_id), time.time() + timeout)
        max_payload = getattr(self.nc, "max_payload", 0) or 0
        if max_payload:
            for item in items:
                size = len(item.to_msgpack())
                if size > max_payload - 1024:
                    raise invalid_input(
                        f"Item {item.item_index} is {size} bytes; the work queue takes at most {max_payload - 1024}",
                        param="items",
                    )
        t0 = time.monotonic()
        results = await self.dispatcher.run(
            request_id, lane, route.model_id, items, operation=operation, deadline=t0 + timeout
        )
        self.demand.clear(lane.machine_profile, lane.bundle)
        self.demand.clear("any", lane.bundle)
        return request_id, results, (time.monotonic() - t0) * 1000.0, lane

    def work_item(
        self,
        *,
        lane: Lane,
        route: Route,
        request_id: str,
        reply: str,
        deadline_ts: float,
        index: int,
        total: int,
        operation: str,
        **fields: Any,
    ) -> WorkItem:
        return WorkItem(
            work_item_id=f"{request_id}.{index}",
            request_id=request_id,
            item_index=index,
            total_items=total,
            operation=operation,
            model_id=route.model_id,
            profile_id=route.resolved.profile_name,
            pool_name=lane.pool,
            machine_profile=lane.machine_profile,
            router_id=self.router_id,
            reply_subject=reply,
            timestamp=time.time(),
            bundle_config_hash=self.registry.bundle_hash(lane.bundle) or None,
            deadline=deadline_ts,
            bundle=lane.bundle,
            **fields,
        )


# ---- helpers ------------------------------------------------------------------------------------


async def read_body(request: web.Request, max_bytes: int) -> Any:
    """The decoded body (msgpack or JSON per Content-Type), refused with 413 beyond ``max_bytes``."""
    raw = await http.read_body(request, max_bytes)
    return http.decode_body(raw, request.headers.get("Content-Type"))


def success_headers(request_id: str, results: list[WorkResult], wait_ms: float) -> dict[str, str]:
    h = {
        "X-SIE-Server-Version": SERVER_VERSION,
        "X-SIE-Version": SERVER_VERSION,
        "X-SIE-Request-ID": request_id,
        "X-SIE-Worker": f"queue:{request_id}",
        "X-Queue-Wait-Time": f"{wait_ms:.1f}",
    }
    t = responses.timing(results, wait_ms)
    h["X-Queue-Time"] = f"{t['queue_ms']:.2f}"
    h["X-Inference-Time"] = f"{t['inference_ms']:.2f}"
    if t["tokenization_ms"] > 0:
        h["X-Tokenization-Time"] = f"{t['tokenization_ms']:.2f}"
    if t.get("postprocessing_ms"):
        h["X-Postprocessing-Time"] = f"{t['postprocessing_ms']:.2f}"
    tokens = responses.input_tokens(results)
    if tokens is not None:
        h["X-SIE-Units-Input-Tokens"] = str(tokens)
    return h


def _respond(
    request: web.Request, msgpack_body: Any, json_body: Any, headers: dict[str, str]
) -> web.Response:
    if wants_msgpack_response(request.headers.get("Accept")):
        return web.Response(body=msgpack_body(), content_type="application/msgpack", headers=headers)
    return web.json_response(json_body(), headers=headers)


def provisioning_response(
    gw: Gateway, request: web.Request, p: Provisioning, *, force_503: bool = False
) -> web.Response:
    gw.metrics.provisioning.labels(p.machine_profile or "any").inc()
    retry_after = gw.settings.gateway_provisioning_retry_after_s
    if force_503 or sdk_understands_503(request):
        return error_response(
            SIEError(
                ErrorCode.PROVISIONING,
                p.message,
                retry_after=retry_after,
                gpu=p.machine_profile,
                bundle=p.bundle,
                pool=p.pool,
            ),
            openai=force_503,
        )
    body = {
        "status": "provisioning",
        "gpu": p.machine_profile,
        "bundle": p.bundle,
        "pool": p.pool,
        "estimated_wait_s": 180,
        "message": p.message,
    }
    return web.json_response(body, status=202, headers={"Retry-After": format_retry_after(retry_after)})


# ---- handlers -----------------------------------------------------------------------------------


def _gw(request: web.Request) -> Gateway:
    return request.app[GATEWAY_KEY]


async def _itemised_request(request: web.Request, model_cls: type) -> tuple[Gateway, str, Any, Any, dict[str, Any], Route]:
    """The common start of encode and extract: body within limits, item count, options, route."""
    gw = _gw(request)
    model = request.match_info["model"]
    data = await read_body(request, gw.settings.gateway_max_body_bytes)
    req = parse_request(model_cls, data)
    if len(req.items) > gw.settings.gateway_max_items:
        raise invalid_input(f"At most {gw.settings.gateway_max_items} items per request", param="items")
    params = req.params
    options = rp.request_options(params.options if params else None)
    route = gw.registry.resolve(model, options)
    options.pop("profile", None)
    return gw, model, data, params, options, route


async def handle_encode(request: web.Request) -> web.Response:
    gw, model, data, params, options, route = await _itemised_request(request, EncodeRequest)
    merged = rp.merged_options(route.resolved, options)
    rp.truncates(merged)
    output_types = rp.output_types(route.resolved, merged, params.output_types if params else None)
    output_dtype = rp.output_dtype(params.output_dtype if params else None, options)
    instruction = rp.instruction(params.instruction if params else None, options)
    is_query = bool(options.get("is_query", False))
    raw_items = data["items"]

    def build(lane: Lane, rid: str, reply: str, deadline_ts: float) -> list[WorkItem]:
        return [
            gw.work_item(
                lane=lane, route=route, request_id=rid, reply=reply, deadline_ts=deadline_ts, index=i,
                total=len(raw_items), operation="encode", item=raw_items[i], output_types=output_types,
                output_dtype=output_dtype, instruction=instruction, is_query=is_query, options=options,
            )
            for i in range(len(raw_items))
        ]  # fmt: skip

    rid, results, wait_ms, _ = await gw.execute(request, route, "encode", build, len(raw_items))
    responses.check_failures(results)
    t = responses.timing(results, wait_ms)
    return _respond(
        request,
        lambda: responses.items_msgpack(model, results, t),
        lambda: responses.items_json(model, results, t),
        success_headers(rid, results, wait_ms),
    )


async def handle_score(request: web.Request) -> web.Response:
    gw = _gw(request)
    model = request.match_info["model"]
    data = await read_body(request, gw.settings.gateway_max_body_bytes)
    req = parse_request(ScoreRequest, data)
    if len(req.items) > gw.settings.gateway_max_score_items:
        raise invalid_input(
            f"At most {gw.settings.gateway_max_score_items} items per score request", param="items"
        )
    options = rp.request_options(req.options)
    route = gw.registry.resolve(model, options)
    options.pop("profile", None)
    if route.resolved.config.tasks.score is None:
        raise invalid_input(f"Model '{route.model_id}' does not support scoring", param="model")
    rp.truncates(rp.merged_options(route.resolved, options))
    instruction = rp.instruction(req.instruction, options)

    def build(lane: Lane, rid: str, reply: str, deadline_ts: float) -> list[WorkItem]:
        return [
            gw.work_item(
                lane=lane, route=route, request_id=rid, reply=reply, deadline_ts=deadline_ts, index=0, total=1,
                operation="score", query_item=data["query"], score_items=data["items"], instruction=instruction,
                options=options, is_query=False,
            )
        ]  # fmt: skip

    rid, results, wait_ms, _ = await gw.execute(request, route, "score", build, 1)
    responses.check_failures(results)
    t = responses.timing(results, wait_ms)
    return _respond(
        request,
        lambda: responses.score_msgpack(model, results[0], t),
        lambda: responses.score_json(model, results[0], t),
        success_headers(rid, results, wait_ms),
    )


async def handle_extract(request: web.Request) -> web.Response:
    gw, model, data, params, options, route = await _itemised_request(request, ExtractRequest)
    if route.resolved.config.tasks.extract is None:
        raise invalid_input(f"Model '{route.model_id}' does not support extraction", param="model")
    rp.truncates(rp.merged_options(route.resolved, options))
    instruction = rp.instruction(params.instruction if params else None, options)
    labels = params.labels if params else None
    output_schema = params.output_schema if params else None
    raw_items = data["items"]

    def build(lane: Lane, rid: str, reply: str, deadline_ts: float) -> list[WorkItem]:
        return [
            gw.work_item(
                lane=lane, route=route, request_id=rid, reply=reply, deadline_ts=deadline_ts, index=i,
                total=len(raw_items), operation="extract", item=raw_items[i], labels=labels,
                output_schema=output_schema, instruction=instruction, options=options,
            )
            for i in range(len(raw_items))
        ]  # fmt: skip

    rid, results, wait_ms, _ = await gw.execute(request, route, "extract", build, len(raw_items))
    item_errors = responses.check_failures(results, allow_item_errors=True)
    t = responses.timing(results, wait_ms)
    return _respond(
        request,
        lambda: responses.items_msgpack(model, results, t, item_errors),
        lambda: responses.items_json(model, results, t, item_errors),
        success_headers(rid, results, wait_ms),
    )


async def handle_embeddings(request: web.Request) -> web.Response:
    """OpenAI-compatible ``POST /v1/embeddings`` (contract 7): JSON in, JSON out, OpenAI errors."""
    gw = _gw(request)
    try:
        return await _embeddings(gw, request)
    except Provisioning as p:
        return provisioning_response(gw, request, p, force_503=True)
    except SIEError as err:
        return error_response(err, openai=True)


async def _embeddings(gw: Gateway, request: web.Request) -> web.Response:
    import base64

    import numpy as np

    data = await read_body(request, gw.settings.gateway_max_body_bytes)
    if not isinstance(data, dict):
        raise invalid_input("Request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_input("'model' is required", param="model")
    inputs = data.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list):
        raise invalid_input("'input' must be a string or an array of strings", param="input")
    if not inputs:
        raise invalid_input("Input cannot be empty", param="input")
    if not all(isinstance(x, str) for x in inputs):
        raise invalid_input("token-array embeddings input is not supported", param="input")
    if len(inputs) > gw.settings.gateway_max_items:
        raise invalid_input(f"At most {gw.settings.gateway_max_items} inputs per request", param="input")
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise invalid_input("encoding_format must be 'float' or 'base64'", param="encoding_format")
    try:
        route = gw.registry.resolve(model)
    except SIEError as err:
        if err.code == ErrorCode.MODEL_NOT_FOUND:
            raise SIEError(ErrorCode.MODEL_NOT_FOUND, err.message, param="model") from None
        raise
    if "dense" not in supported_outputs(route.resolved):
        raise invalid_input(f"Model '{model}' does not produce dense embeddings", param="model")
    dims = data.get("dimensions")
    enc = route.resolved.config.tasks.encode
    native = enc.dense.dim if enc and enc.dense else None
    if dims is not None and dims != native:
        err = invalid_input(
            f"dimensions must equal the model's native dimension ({native})", param="dimensions"
        )
        err.extra["openai_code"] = "unsupported_field"
        raise SIEError("unsupported_field", err.message, status=400, param="dimensions")
    runtime = route.resolved.runtime_options
    instruction = runtime.get("instruction")
    is_query = bool(runtime.get("is_query", False))

    def build(lane: Lane, rid: str, reply: str, deadline_ts: float) -> list[WorkItem]:
        return [
            gw.work_item(
                lane=lane, route=route, request_id=rid, reply=reply, deadline_ts=deadline_ts, index=i,
                total=len(inputs), operation="encode", item={"text": inputs[i]}, output_types=["dense"],
                output_dtype="float32", instruction=instruction, is_query=is_query, options={},
            )
            for i in range(len(inputs))
        ]  # fmt: skip

    rid, results, wait_ms, _ = await gw.execute(request, route, "encode", build, len(inputs))
    responses.check_failures(results)
    out = []
    for r in results:
        item = unpackb(r.result_msgpack) if r.result_msgpack else {}
        values = np.asarray((item.get("dense") or {}).get("values"), dtype=np.float32).reshape(-1)
        if fmt == "base64":
            emb: Any = base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
        else:
            emb = [float(v) for v in values]
        out.append({"object": "embedding", "embedding": emb, "index": r.item_index})
    tokens = responses.input_tokens(results)
    source = "worker"
    if tokens is None:
        tokens = max(1, sum(len(s) for s in inputs) // 4)
        source = "character_estimate"
    body = {
        "object": "list",
        "data": out,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "sie_token_source": source},
    }
    return web.json_response(body, headers=success_headers(rid, results, wait_ms))


def _model_state(gw: Gateway, name: str) -> tuple[bool, int]:
    base = name
    loaded_on = [
        w
        for w in gw.workers.healthy()
        if name in w.heartbeat.loaded_models or base in w.heartbeat.loaded_models
    ]
    return bool(loaded_on), len(loaded_on)


async def handle_models(request: web.Request) -> web.Response:
    gw = _gw(request)
    entries = []
    for e in gw.registry.model_entries():
        loaded, n = _model_state(gw, e["name"].split(":")[0])
        entries.append(
            {
                **e,
                "loaded": loaded,
                "state": "loaded" if loaded else "available",
                "aliases": [],
                "worker_count": n,
            }
        )
    return web.json_response({"models": entries})


async def handle_model(request: web.Request) -> web.Response:
    gw = _gw(request)
    e = gw.registry.model_entry(request.match_info["model"])
    loaded, n = _model_state(gw, e["name"].split(":")[0])
    return web.json_response({**e, "loaded": loaded, "state": "loaded" if loaded else "available", "aliases": [], "worker_count": n, "id": e["name"], "object": "model", "owned_by": "sie"})  # fmt: skip


async def handle_health(request: web.Request) -> web.Response:
    gw = _gw(request)
    healthy = gw.workers.healthy()
    workers = []
    for w in gw.workers.all():
        hb = w.heartbeat
        workers.append(
            {
                "name": hb.name or w.worker_id,
                "url": f"nats:{w.worker_id}",
                "gpu": w.profile,
                "gpu_count": hb.gpu_count,
                "ready_gpu_slots": hb.ready_gpu_slots,
                "healthy": gw.workers.is_healthy(w),
                "queue_depth": hb.queue_depth,
                "pending_cost": hb.pending_cost,
                "inflight_batches": hb.inflight_batches,
                "loaded_models": list(hb.loaded_models),
                "memory_used_bytes": hb.memory_used_bytes,
                "memory_total_bytes": hb.memory_total_bytes,
                "bundle": w.bundle,
                "bundle_config_hash": hb.bundle_config_hash,
                "pool": w.pool,
            }
        )
    models: dict[str, dict[str, Any]] = {}
    for w in healthy:
        for m in w.heartbeat.loaded_models:
            entry = models.setdefault(
                m, {"name": m, "state": "loaded", "worker_count": 0, "gpu_types": [], "total_queue_depth": 0}
            )
            entry["worker_count"] += 1
            entry["total_queue_depth"] += w.heartbeat.queue_depth
            if w.profile not in entry["gpu_types"]:
                entry["gpu_types"].append(w.profile)
    status = "healthy" if healthy else "no_workers"
    if healthy and len(healthy) < len(gw.workers.all()):
        status = "degraded"
    if not gw.nc.is_connected:
        status = "degraded"
    body = {
        "type": "gateway",
        "status": status,
        "version": SERVER_VERSION,
        "router_id": gw.router_id,
        "nats_connected": gw.nc.is_connected,
        "cluster": {
            "worker_count": len(healthy),
            "gpu_count": sum(w.heartbeat.gpu_count for w in healthy),
            "models_loaded": len(models),
            "total_qps": 0.0,
        },
        "configured_gpu_types": gw.settings.configured_gpus(),
        "live_gpu_types": gw.workers.live_profiles(),
        "workers": workers,
        "models": list(models.values()),
    }
    return web.json_response(body, headers={"X-SIE-Server-Version": SERVER_VERSION})


async def handle_healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_readyz(request: web.Request) -> web.Response:
    gw = _gw(request)
    if not gw.registry.ready():
        return web.json_response({"status": "not ready", "reason": "config bootstrap pending"}, status=503)
    if not gw.nc.is_connected:
        return web.json_response({"status": "not ready", "reason": "NATS disconnected"}, status=503)
    # a new replica has heard no heartbeat yet and would answer PROVISIONING for live lanes
    since = getattr(gw, "heartbeats_since", None)
    if since is None or time.monotonic() - since < gw.settings.gateway_worker_warmup_s:
        return web.json_response({"status": "not ready", "reason": "worker registry warming up"}, status=503)
    return web.json_response({"status": "ready", "healthy_workers": len(gw.workers.healthy())})


async def handle_metrics(request: web.Request) -> web.Response:
    gw = _gw(request)
    m = gw.metrics
    gw.demand.refresh(gw.lane_served)
    m.nats_connected.set(1 if gw.nc.is_connected else 0)
    healthy = gw.workers.healthy()
    m.workers.labels("healthy").set(len(healthy))
    m.workers.labels("unhealthy").set(len(gw.workers.all()) - len(healthy))
    m.worker_queue_depth.clear()
    for w in healthy:
        m.worker_queue_depth.labels(w.worker_id, w.profile, w.bundle).set(w.heartbeat.queue_depth)
    return web.Response(body=m.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---- pools --------------------------------------------------------------------------------------


def _pools(request: web.Request) -> PoolStore:
    pools = _gw(request).pools
    if pools is None:
        raise SIEError(ErrorCode.QUEUE_UNAVAILABLE, "Pool store is not ready", retry_after=2)
    return pools


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        raise invalid_input("Pool body must be JSON") from None


async def handle_pool_create(request: web.Request) -> web.Response:
    view = await _pools(request).create(await _json_body(request))
    return web.json_response(view, status=201)


async def handle_pool_list(request: web.Request) -> web.Response:
    return web.json_response({"pools": await _pools(request).list()})


async def handle_pool_get(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    view = await _pools(request).get(name)
    if view is None:
        raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{name.lower()}' not found")
    return web.json_response(view)


async def handle_pool_renew(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not await _pools(request).renew(name):
        raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{name.lower()}' not found")
    return web.json_response({"message": "Pool renewed"})


async def handle_pool_delete(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not await _pools(request).delete(name):
        raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{name.lower()}' not found")
    return web.json_response({"message": "Pool deleted"})


# ---- read-side config API (mirror of the config service) ------------------------------------------


def _config_error(status: int, error: str, message: str, **extra: Any) -> web.Response:
    return web.json_response({"detail": {"error": error, "message": message, **extra}}, status=status)


async def handle_config_models(request: web.Request) -> web.Response:
    return web.json_response(_gw(request).registry.config_models())


async def handle_config_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    text = _gw(request).registry.config_model_yaml(model_id)
    if text is None:
        return _config_error(404, "model_not_found", f"model {model_id!r} is not configured", model_id=model_id)
    return web.Response(text=text, content_type="application/x-yaml")


async def handle_config_bundles(request: web.Request) -> web.Response:
    return web.json_response(_gw(request).registry.config_bundles())


async def handle_config_bundle(request: web.Request) -> web.Response:
    import yaml

    bundle_id = request.match_info["bundle_id"]
    doc = _gw(request).registry.config_bundle(bundle_id)
    if doc is None:
        return _config_error(404, "bundle_not_found", f"bundle {bundle_id!r} is not known", bundle_id=bundle_id)
    if request.query.get("format") == "json" or "application/json" in request.headers.get("Accept", ""):
        return web.json_response(doc)
    return web.Response(text=yaml.safe_dump(doc, sort_keys=False), content_type="application/x-yaml")


async def handle_config_epoch(request: web.Request) -> web.Response:
    return web.json_response(_gw(request).registry.config_epoch())


async def handle_config_write(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "detail": {
                "error": "method_not_allowed",
                "message": "The gateway serves a read-only mirror of the config; send writes to the config service",
            }
        },
        status=405,
        headers={"Allow": "GET"},
    )


# ---- middleware and app -------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    gw = _gw(request)
    t0 = time.monotonic()
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        auth.check(
            request,
            enabled=gw.settings.auth_enabled,
            tokens=gw.settings.inference_tokens(),
            admin_token=gw.settings.admin_token,
            exempt_operational=gw.settings.auth_exempt_operational,
        )
        response = await handler(request)
        status = response.status
        return response
    except Provisioning as p:
        response = provisioning_response(gw, request, p)
        status = response.status
        return response
    except SIEError as err:
        status = err.status
        gw.metrics.rejected.labels("", "", err.code.lower()).inc()
        resp = error_response(err, openai=request.path == "/v1/embeddings")
        if REQUEST_ID_KEY in request:
            resp.headers["X-SIE-Request-ID"] = request[REQUEST_ID_KEY]
        resp.headers["X-SIE-Server-Version"] = SERVER_VERSION
        return resp
    except web.HTTPException as exc:
        status = exc.status
        if exc.status >= 400:
            code = ErrorCode.NOT_FOUND if exc.status == 404 else ErrorCode.INVALID_INPUT
            return web.json_response(
                {"detail": {"code": code.value, "message": exc.reason}},
                status=exc.status,
                headers={"X-SIE-Error-Code": code.value},
            )
        raise
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        err = SIEError(
            ErrorCode.QUEUE_UNAVAILABLE,
            f"NATS unavailable ({type(exc).__name__}); retry later",
            retry_after=2,
        )
        status = err.status
        return error_response(err, openai=request.path == "/v1/embeddings")
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as exc:  # never leak a traceback; never disturb other requests
        log.exception("unhandled error on %s", request.path)
        err = SIEError(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
        return error_response(err)
    finally:
        profile = request.headers.get("X-SIE-MACHINE-PROFILE", "") or ""
        gw.metrics.requests.labels(endpoint, str(status), profile.lower()[:64]).inc()
        gw.metrics.latency.labels(endpoint).observe(time.monotonic() - t0)


def create_app(
    settings: GatewaySettings,
    nc: NATS,
    registry: ModelRegistry,
    *,
    router_id: str | None = None,
) -> web.Application:
    gateway = Gateway(settings, nc, registry, router_id=router_id)
    app = web.Application(client_max_size=settings.gateway_max_body_bytes + 1, middlewares=[error_middleware])
    app[GATEWAY_KEY] = gateway
    r = app.router
    r.add_post("/v1/encode/{model:.+}", handle_encode)
    r.add_post("/v1/score/{model:.+}", handle_score)
    r.add_post("/v1/extract/{model:.+}", handle_extract)
    r.add_post("/v1/embeddings", handle_embeddings)
    r.add_get("/v1/models", handle_models)
    r.add_get("/v1/models/{model:.+}", handle_model)
    r.add_get("/health", handle_health)
    r.add_get("/healthz", handle_healthz)
    r.add_get("/readyz", handle_readyz)
    r.add_get("/metrics", handle_metrics)
    r.add_post("/v1/pools", handle_pool_create)
    r.add_get("/v1/pools", handle_pool_list)
    r.add_get("/v1/pools/{name}", handle_pool_get)
    r.add_post("/v1/pools/{name}/renew", handle_pool_renew)
    r.add_delete("/v1/pools/{name}", handle_pool_delete)
    r.add_get("/v1/configs/models", handle_config_models)
    r.add_get("/v1/configs/models/{model_id:.+}", handle_config_model)
    r.add_get("/v1/configs/bundles", handle_config_bundles)
    r.add_get("/v1/configs/bundles/{bundle_id}", handle_config_bundle)
    r.add_get("/v1/configs/epoch", handle_config_epoch)
    r.add_post("/v1/configs/models", handle_config_write)
    for method in ("POST", "PUT", "DELETE"):
        r.add_route(method, "/v1/configs/models/{model_id:.+}", handle_config_write)
    r.add_put("/v1/configs/models", handle_config_write)
    r.add_delete("/v1/configs/models", handle_config_write)

    async def on_startup(app: web.Application) -> None:
        await gateway.start()

    async def on_cleanup(app: web.Application) -> None:
        await gateway.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
