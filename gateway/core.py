"""The gateway's per-process state and its lifecycle: the parts composed, started and stopped.

:class:`Gateway` composes the parts of the gateway, each with one job: the dispatcher (publish and
collect, :mod:`gateway.dispatch`), lane choice (:mod:`gateway.lanes`), the work messages
(:mod:`gateway.jobs`), running a request with the result cache (:mod:`gateway.executor`), the
heartbeats (:mod:`gateway.heartbeats`), pools, batches, the DLQ forwarder and metrics. It opens the
stores at start, runs the housekeeping loop, and drains and stops the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

from gateway import same_items
from gateway.admission import Admission
from gateway.batches import BatchRunner, BatchStore
from gateway.dispatch import Dispatcher
from gateway.dlq import DLQForwarder
from gateway.executor import Executor
from gateway.heartbeats import HeartbeatListener
from gateway.jobs import JobBuilder
from gateway.lanes import LaneChooser
from gateway.metrics import DemandTracker, GatewayMetrics
from gateway.pools import PoolStore
from gateway.readiness import MetricsPage, Readiness
from gateway.registry import ModelRegistry
from gateway.result_cache import ResultCache
from gateway.settings import GatewaySettings
from gateway.stores import Stores
from gateway.workers import WorkerRegistry
from protocol.streams import dlq_stream_config
from protocol.subjects import pin_subject

log = logging.getLogger(__name__)


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")


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
        self.heartbeats = HeartbeatListener(nc, self.workers)
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
            direct_after_s=settings.gateway_direct_after_s,
            queue_full_retry_after_s=settings.gateway_queue_full_retry_after_s,
            bulk_share=settings.gateway_bulk_share,
            router_id=router_id,
        )
        self.stores = Stores()
        self.batch_runner: BatchRunner | None = None
        self.lanes = LaneChooser(settings, self.workers, self.demand, lambda: self.stores.pools)
        self.jobs = JobBuilder(
            router_id=self.router_id,
            results_subject=self.dispatcher.inbox.results_subject,
            bundle_hash=registry.bundle_hash,
            healthy=self.workers.healthy,
            payloads=self.dispatcher.payloads,
            offloads=self.metrics.payload_offloads,
            max_payload=lambda: getattr(nc, "max_payload", 0) or 0,
            chunk_items=settings.gateway_work_chunk_items,
        )
        self.executor = Executor(
            lanes=self.lanes,
            jobs=self.jobs,
            streams=self.dispatcher.streams,
            dispatcher=self.dispatcher,
            cache=lambda: self.stores.cache,
            computing=same_items.InFlight(self.metrics.cache_followed.inc),
            demand=self.demand,
            connected=lambda: nc.is_connected,
            timeout_s=settings.gateway_request_timeout_s,
            spawn=self._spawn,
        )
        self.dlq = DLQForwarder(nc, self.router_id, self.dispatcher.inbox, self.metrics)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False  # background loops end on this too: library code may swallow a cancel
        self.admission = Admission()
        self.readiness = Readiness(
            self.admission,
            self.workers,
            connected=lambda: nc.is_connected,
            config_ready=registry.ready,
            listening_since=lambda: self.heartbeats.listening_since,
            warmup_s=settings.gateway_worker_warmup_s,
        )
        self.metrics_page = MetricsPage(
            self.metrics,
            self.demand,
            self.workers,
            lane_served=self.lanes.lane_served,
            connected=lambda: nc.is_connected,
        )

    @property
    def router_id(self) -> str:
        return self.dispatcher.router_id

    async def start(self) -> None:
        js = self.nc.jetstream()
        await self.dispatcher.start()
        await self.heartbeats.start()
        try:
            await js.add_stream(
                StreamConfig(
                    **dlq_stream_config(
                        storage=self.settings.stream_storage, replicas=self.settings.stream_replicas
                    )
                )
            )
        except Exception as exc:  # exists with other settings, or JetStream busy: forwarding still works
            log.info("DEAD_LETTERS stream not (re)created: %s", exc)
        await self.dlq.start()
        s = self.settings
        self.stores.pools = await PoolStore.open(
            js,
            s.pool_bucket,
            self.workers,
            storage=s.stream_storage,
            replicas=s.stream_replicas,
            default_ttl_s=s.pool_ttl_s,
            max_ttl_s=s.pool_max_ttl_s,
            max_pools=s.pool_max_count,
            known_profiles=self.lanes.known_profiles,
            known_bundles=self.registry.bundle_names,
            check_model=lambda m: self.registry.resolve(m),
            on_event=lambda e: self.metrics.pool_events.labels(e).inc(),
        )
        if s.result_cache_enabled:
            self.stores.cache = await ResultCache.open(
                js,
                s.result_cache_bucket,
                self.metrics,
                ttl_s=s.result_cache_ttl_s,
                max_bytes=s.result_cache_max_bytes,
                max_value_bytes=s.result_cache_max_value_bytes,
                storage=s.stream_storage,
                replicas=s.stream_replicas,
                timeout_s=s.result_cache_timeout_s,
            )
        if s.batch_enabled:
            self.stores.batches = await BatchStore.open(
                js, storage=s.stream_storage, replicas=s.stream_replicas
            )
            self.batch_runner = BatchRunner(
                self.stores.batches,
                self.router_id,
                lines_in_flight=s.batch_lines_in_flight,
                chunk_lines=s.batch_chunk_lines,
                max_lines=s.batch_max_lines,
                lease_s=s.batch_lease_s,
            )  # its lines go to this gateway's own URL, set once the server listens (run_batches)
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
        await self.heartbeats.stop()
        with contextlib.suppress(Exception):
            await self.registry.stop()
        await self.dlq.stop()
        await self.dispatcher.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, kept until it ends (its errors are its own to log)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def run_batches(self, base_url: str) -> None:
        """Start running batches, sending their lines to ``base_url`` (this gateway's front door)."""
        if self.batch_runner is not None and self.batch_runner.base_url is None:
            self.batch_runner.base_url = base_url.rstrip("/")
            self._tasks.append(asyncio.create_task(self.batch_runner.run(), name="batches"))

    def on_reconnect(self) -> None:
        self.dispatcher.on_reconnect()
        self._spawn(self.heartbeats.solicit())  # workers gone stale while it was away: hear them now

    async def publish_pins(self) -> int:
        """Tell every healthy worker's sidecar which models its pools pin (an empty list: none), so
        that they are loaded there and never evicted; repeated each interval, so a restarted
        sidecar or a newly assigned worker learns them. Returns how many workers were told."""
        pools = self.stores.pools
        if pools is None:
            return 0
        pins = await pools.pins()
        told = 0
        for worker in self.workers.healthy():
            models = pins.get(worker.worker_id, [])
            await self.nc.publish(pin_subject(worker.worker_id), json.dumps({"models": models}).encode())
            told += 1
        return told

    async def _housekeeping(self) -> None:
        last_sweep = last_pins = 0.0
        while not self._stopping:
            await asyncio.sleep(1.0)
            try:
                self.workers.prune()
                self.demand.refresh(self.lanes.lane_served)
                now = time.monotonic()
                pools = self.stores.pools
                if pools is not None and now - last_sweep >= self.settings.pool_sweep_interval_s:
                    last_sweep = now
                    await pools.sweep()
                if now - last_pins >= self.settings.pool_pin_interval_s:
                    last_pins = now
                    await self.publish_pins()
            except Exception as exc:
                log.warning("housekeeping failed: %s", exc)
