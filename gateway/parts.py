"""The parts of the gateway that the HTTP handlers and the middleware are given, by app key: each
handler reads the part it needs, never the whole :class:`gateway.core.Gateway`."""

from __future__ import annotations

from aiohttp import web

from gateway.admission import Admission
from gateway.executor import Executor
from gateway.metrics import GatewayMetrics
from gateway.readiness import MetricsPage, Readiness
from gateway.registry import ModelRegistry
from gateway.settings import GatewaySettings
from gateway.stores import Stores
from gateway.workers import WorkerRegistry

SETTINGS_KEY = web.AppKey("settings", GatewaySettings)
REGISTRY_KEY: web.AppKey[ModelRegistry] = web.AppKey("registry")
WORKERS_KEY = web.AppKey("workers", WorkerRegistry)
EXECUTOR_KEY = web.AppKey("executor", Executor)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)
METRICS_PAGE_KEY = web.AppKey("metrics_page", MetricsPage)
ADMISSION_KEY = web.AppKey("admission", Admission)
READINESS_KEY = web.AppKey("readiness", Readiness)
STORES_KEY = web.AppKey("stores", Stores)
ROUTER_ID_KEY = web.AppKey("router_id", str)
