"""The gateway's HTTP application: same public API as ``sie serve``, served through NATS JetStream.

``create_app(settings, nc, registry)`` builds an aiohttp app around a :class:`gateway.core.Gateway`, which
composes the parts of the gateway and runs their lifecycle. Handlers live in ``gateway/routes/`` (one
module per concern), the middleware in ``gateway/middleware.py``; each reads the part it needs by its
app key (:mod:`gateway.parts`).
"""

from __future__ import annotations

from aiohttp import web
from nats.aio.client import Client as NATS

from gateway.core import GATEWAY_KEY, Gateway
from gateway.middleware import error_middleware
from gateway.parts import (
    ADMISSION_KEY,
    EXECUTOR_KEY,
    METRICS_KEY,
    METRICS_PAGE_KEY,
    READINESS_KEY,
    REGISTRY_KEY,
    ROUTER_ID_KEY,
    SETTINGS_KEY,
    STORES_KEY,
    WORKERS_KEY,
)
from gateway.registry import ModelRegistry
from gateway.routes import docs as api_docs
from gateway.routes.batches import (
    handle_batch_cancel,
    handle_batch_create,
    handle_batch_get,
    handle_batch_list,
    handle_file_content,
    handle_file_delete,
    handle_file_get,
    handle_file_list,
    handle_file_upload,
)
from gateway.routes.config import (
    handle_config_bundle,
    handle_config_bundles,
    handle_config_epoch,
    handle_config_model,
    handle_config_models,
    handle_config_write,
)
from gateway.routes.inference import handle_encode, handle_extract, handle_score, handle_tokenize
from gateway.routes.openai import handle_embeddings
from gateway.routes.pools import (
    handle_pool_create,
    handle_pool_delete,
    handle_pool_get,
    handle_pool_list,
    handle_pool_renew,
)
from gateway.routes.rerank import handle_rerank
from gateway.routes.rollout import handle_config_model_status
from gateway.routes.status import (
    STATUS_SOCKETS,
    handle_health,
    handle_healthz,
    handle_index,
    handle_metrics,
    handle_model,
    handle_models,
    handle_readyz,
    handle_ws_cluster_status,
)
from gateway.settings import GatewaySettings
from iokit import openapi
from iokit.http import close_status_sockets
from protocol import rerank

__all__ = ["GATEWAY_KEY", "create_app"]


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
    app[SETTINGS_KEY] = settings
    app[REGISTRY_KEY] = registry
    app[WORKERS_KEY] = gateway.workers
    app[EXECUTOR_KEY] = gateway.executor
    app[METRICS_KEY] = gateway.metrics
    app[METRICS_PAGE_KEY] = gateway.metrics_page
    app[ADMISSION_KEY] = gateway.admission
    app[READINESS_KEY] = gateway.readiness
    app[STORES_KEY] = gateway.stores
    app[ROUTER_ID_KEY] = gateway.router_id
    app[STATUS_SOCKETS] = set()
    r = app.router
    r.add_post("/v1/encode/{model:.+}", handle_encode)
    r.add_post("/v1/score/{model:.+}", handle_score)
    r.add_post("/v1/extract/{model:.+}", handle_extract)
    r.add_post("/v1/tokenize/{model:.+}", handle_tokenize)
    r.add_post("/v1/embeddings", handle_embeddings)
    for path in rerank.ROUTES:
        r.add_post(path, handle_rerank)
    r.add_get("/v1/models", handle_models)
    r.add_get("/v1/models/{model:.+}", handle_model)
    r.add_get("/", handle_index)
    r.add_get("/health", handle_health)
    r.add_get("/ws/cluster-status", handle_ws_cluster_status)
    r.add_get("/healthz", handle_healthz)
    r.add_get("/readyz", handle_readyz)
    r.add_get("/metrics", handle_metrics)
    r.add_post("/v1/files", handle_file_upload)
    r.add_get("/v1/files", handle_file_list)
    r.add_get("/v1/files/{file_id}", handle_file_get)
    r.add_get("/v1/files/{file_id}/content", handle_file_content)
    r.add_delete("/v1/files/{file_id}", handle_file_delete)
    r.add_post("/v1/batches", handle_batch_create)
    r.add_get("/v1/batches", handle_batch_list)
    r.add_get("/v1/batches/{batch_id}", handle_batch_get)
    r.add_post("/v1/batches/{batch_id}/cancel", handle_batch_cancel)
    r.add_post("/v1/pools", handle_pool_create)
    r.add_get("/v1/pools", handle_pool_list)
    r.add_get("/v1/pools/{name}", handle_pool_get)
    r.add_post("/v1/pools/{name}/renew", handle_pool_renew)
    r.add_delete("/v1/pools/{name}", handle_pool_delete)
    r.add_get("/v1/configs/models", handle_config_models)
    r.add_get("/v1/configs/models/{model_id:.+}/status", handle_config_model_status)  # before the catch-all
    r.add_get("/v1/configs/models/{model_id:.+}", handle_config_model)
    r.add_get("/v1/configs/bundles", handle_config_bundles)
    r.add_get("/v1/configs/bundles/{bundle_id}", handle_config_bundle)
    r.add_get("/v1/configs/epoch", handle_config_epoch)
    r.add_post("/v1/configs/models", handle_config_write)
    for method in ("POST", "PUT", "DELETE"):
        r.add_route(method, "/v1/configs/models/{model_id:.+}", handle_config_write)
    r.add_put("/v1/configs/models", handle_config_write)
    openapi.add_routes(app, api_docs.TITLE, api_docs.build)
    r.add_delete("/v1/configs/models", handle_config_write)

    async def on_startup(app: web.Application) -> None:
        await gateway.start()

    async def on_cleanup(app: web.Application) -> None:
        await gateway.stop()

    async def on_shutdown(app: web.Application) -> None:
        await close_status_sockets(app[STATUS_SOCKETS])

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app
