"""Models, health, readiness and metrics routes."""

from __future__ import annotations

import os
from typing import Any, TypedDict

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.parts import (
    METRICS_PAGE_KEY,
    READINESS_KEY,
    REGISTRY_KEY,
    ROUTER_ID_KEY,
    SETTINGS_KEY,
    WORKERS_KEY,
)
from gateway.workers import WorkerRegistry
from iokit.http import READY_PID_HEADER, index_body, stream_status
from protocol import SERVER_VERSION, openai
from protocol.weights import best as best_weights

#: the open ``/ws/cluster-status`` sockets (closed at shutdown)
STATUS_SOCKETS = web.AppKey("status_sockets", set)
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
    "/v1/pools",
    "/v1/configs/models",
    "/health",
    "/ws/cluster-status",
    "/metrics",
]


class LoadError(TypedDict):
    code: str
    message: str


class ModelView(TypedDict):
    """What ``/v1/models`` adds to a model's entry: its state over the healthy workers."""

    loaded: bool
    state: str
    last_error: LoadError | None
    worker_count: int
    weights: str


def model_view(workers: WorkerRegistry, spec: str) -> ModelView:
    """``loaded``/``state``/``last_error``/``worker_count``/``weights`` of one routable name over the
    healthy workers.

    Per profile from the heartbeats' ``model_states`` (loaded > loading > failed > available); a
    heartbeat without them (an older sidecar) counts by model id. ``weights``: the best any of them
    reports for the model id (protocol.weights), ``unknown`` when none does.
    """
    model_id = spec.split(":")[0]
    states: list[str] = []
    errors: list[str] = []
    weights: list[str] = []
    for w in workers.healthy():
        if found := w.heartbeat.weights.get(model_id):
            weights.append(found)
        per_profile = w.profile_states()
        if per_profile:
            if spec in per_profile:
                states.append(per_profile[spec])
            if per_profile.get(spec) == "failed" and (msg := w.load_errors(model_id).get(spec)):
                errors.append(msg)
        elif w.has_loaded(model_id):
            states.append("loaded")
    n = states.count("loaded")
    state = next((s for s in ("loaded", "loading", "failed") if s in states), "available")
    last_error: LoadError | None = (
        {"code": "MODEL_LOAD_FAILED", "message": errors[-1]} if state == "failed" and errors else None
    )
    return {
        "loaded": n > 0,
        "state": state,
        "last_error": last_error,
        "worker_count": n,
        "weights": best_weights(weights),  # beside the contract's fields: can a load find them?
    }


async def handle_models(request: web.Request) -> web.Response:
    workers = request.app[WORKERS_KEY]
    entries = [
        {**e, **model_view(workers, e["name"]), "aliases": []}
        for e in request.app[REGISTRY_KEY].model_entries()
    ]
    return web.json_response(openai.models_response(entries))


async def handle_model(request: web.Request) -> web.Response:
    e = request.app[REGISTRY_KEY].model_entry(request.match_info["model"])
    return web.json_response({**e, **model_view(request.app[WORKERS_KEY], e["name"]), "aliases": [], "id": e["name"], "object": "model", "owned_by": "sie"})  # fmt: skip


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response(health_body(request.app), headers={"X-SIE-Server-Version": SERVER_VERSION})


async def handle_ws_cluster_status(request: web.Request) -> web.WebSocketResponse:
    """``watch()``: the /health body as a JSON frame every second."""
    app = request.app
    return await stream_status(request, lambda: health_body(app), 1.0, app[STATUS_SOCKETS])


async def handle_index(request: web.Request) -> web.Response:
    return web.json_response(index_body("gateway", INDEX_ROUTES))


def health_body(app: web.Application) -> dict[str, Any]:
    """What the cluster looks like from this gateway: workers, lanes' models, capacity."""
    registry = app[WORKERS_KEY]
    connected = app[READINESS_KEY].nats_connected()
    healthy = registry.healthy()
    workers = []
    for w in registry.all():
        hb = w.heartbeat
        workers.append(
            {
                "name": hb.name or w.worker_id,
                "url": f"nats:{w.worker_id}",
                "gpu": w.profile,
                "gpu_count": hb.gpu_count,
                "ready_gpu_slots": hb.ready_gpu_slots,
                "healthy": registry.is_healthy(w),
                "queue_depth": hb.queue_depth,
                "pending_cost": hb.pending_cost,
                "inflight_batches": hb.inflight_batches,
                "loaded_models": list(hb.loaded_models),
                "pinned_models": list(hb.pinned_models),
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
    if healthy and len(healthy) < len(registry.all()):
        status = "degraded"
    if not connected:
        status = "degraded"
    body = {
        "type": "gateway",
        "status": status,
        "version": SERVER_VERSION,
        "router_id": app[ROUTER_ID_KEY],
        "nats_connected": connected,
        "cluster": {
            "worker_count": len(healthy),
            "gpu_count": sum(w.heartbeat.gpu_count for w in healthy),
            "models_loaded": len(models),
            "total_qps": 0.0,
        },
        "configured_gpu_types": app[SETTINGS_KEY].configured_gpus(),
        "live_gpu_types": registry.live_profiles(),
        "workers": workers,
        "models": list(models.values()),
    }
    return body


async def handle_healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_readyz(request: web.Request) -> web.Response:
    readiness = request.app[READINESS_KEY]
    reason = readiness.not_ready()
    if reason is not None:
        return web.json_response({"status": "not ready", "reason": reason}, status=503)
    # the answering process: replicas sharing a port (sie up --gateways N) are told apart by it
    return web.json_response(
        {"status": "ready", "healthy_workers": readiness.healthy_workers()},
        headers={READY_PID_HEADER: str(os.getpid())},
    )


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_PAGE_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
