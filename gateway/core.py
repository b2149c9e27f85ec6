"""The gateway's per-process state and its request path: lifecycle, lane choice, publish and collect.

:class:`Gateway` holds the dispatcher, worker registry, pools, demand and metrics, and the NATS
tasks; the HTTP handlers in ``gateway/routes/`` call :meth:`Gateway.execute`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

from gateway import routing
from gateway.dispatch import Dispatcher
from gateway.dlq import DLQForwarder
from gateway.metrics import DemandTracker, GatewayMetrics
from gateway.pools import DEFAULT_POOL, PoolStore, normalize_pool_name
from gateway.registry import ModelRegistry, Route
from gateway.routing import Lane
from gateway.settings import GatewaySettings
from gateway.workers import WorkerRegistry
from protocol import http
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.streams import dlq_stream_config
from protocol.subjects import HEALTH_PREFIX
from protocol.work import WorkItem, WorkResult

log = logging.getLogger(__name__)


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
REQUEST_ID_KEY = web.RequestKey("sie_request_id", str)


# Builds a request's work items once its lane is chosen: (lane, request_id, reply_subject, deadline_ts).
ItemBuilder = Callable[[Lane, str, str, float], list[WorkItem]]

class Provisioning(SIEError):
    """No healthy worker can serve the lane yet (scale from zero, or a pool still pending).

    A PROVISIONING error; how it is answered (202 or 503) depends on the client, see
    :func:`gateway.http_common.provisioning_response`.
    """

    def __init__(
        self, machine_profile: str | None, bundle: str, pool: str, message: str, *, retry_after: float
    ) -> None:
        super().__init__(
            ErrorCode.PROVISIONING,
            message,
            retry_after=retry_after,
            gpu=machine_profile,
            bundle=bundle,
            pool=pool,
        )
        self.machine_profile = machine_profile
        self.bundle = bundle
        self.pool = pool


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
        self._stopping = False  # background loops end on this too: library code may swallow a cancel
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
        self._stopping = True
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
        while not self._stopping:
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
        return routing.lane_served(self.workers.healthy(), machine_profile, bundle)

    def canonical_profile(self, value: str | None) -> str | None:
        return routing.canonical_profile(value, self.settings.configured_gpus(), self.workers.live_profiles())

    def routing_headers(self, request: web.Request) -> tuple[str | None, str | None]:
        pool, profile = routing.split_routing_headers(
            request.headers.get("X-SIE-MACHINE-PROFILE"), request.headers.get("X-SIE-Pool")
        )
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
            raise Provisioning(
                profile,
                bundle,
                queue_pool,
                routing.provisioning_message(route.model_id, profile, pool_name),
                retry_after=self.settings.gateway_provisioning_retry_after_s,
            )
        return routing.best_lane(route.model_id, route.bundles, queue_pool, candidates)

    # ---- running a request -----------------------------------------------------------------
    async def execute(
        self,
        request: web.Request,
        route: Route,
        operation: str,
        build: ItemBuilder,
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
        request_id = http.new_request_id()
        request[REQUEST_ID_KEY] = request_id
        timeout = self.settings.gateway_request_timeout_s
        items = build(lane, request_id, self.dispatcher.reply_subject(request_id), time.time() + timeout)
        payloads = [item.to_msgpack() for item in items]  # encoded once: checked here, published as is
        max_payload = getattr(self.nc, "max_payload", 0) or 0
        if max_payload:
            for item, payload in zip(items, payloads, strict=True):
                if len(payload) > max_payload - 1024:
                    raise invalid_input(
                        f"Item {item.item_index} is {len(payload)} bytes; the work queue takes at most "
                        f"{max_payload - 1024}",
                        param="items",
                    )
        t0 = time.monotonic()
        results = await self.dispatcher.run(
            request_id, lane, route.model_id, items, payloads, operation=operation, deadline=t0 + timeout
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
