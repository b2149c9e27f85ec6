"""The worker pod's metrics port: the sidecar's own metrics, and the worker's fetched over IPC.

``GET /metrics`` on ``SIE_METRICS_PORT`` answers the Prometheus text exposition of

* the sidecar (``sie_sidecar_*``): deliveries by outcome, redeliveries, queue wait (publish → pull),
  batch size, RunBatch time, what it holds, and the lane durable's depth read from JetStream at
  scrape time (``num_pending`` + ``num_ack_pending``, the number an autoscaler wants);
* the worker (``sie_worker_*``, :mod:`worker.metrics`), asked with the IPC ``Metrics`` method.
  ``sie_sidecar_worker_metrics_up`` says whether that answer came.

One port per pod, so one PodMonitor endpoint scrapes the whole pod.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from nats.js.api import ConsumerInfo

log = logging.getLogger("sie.sidecar.metrics")

SCRAPE_CALL_TIMEOUT_S = 2.0
LANE_LABELS = ("pool", "machine_profile", "bundle")


class ConsumerInfoSource(Protocol):
    async def consumer_info(self, stream: str, consumer: str) -> ConsumerInfo: ...


class WorkerMetricsSource(Protocol):
    async def metrics_text(self, timeout_s: float) -> bytes: ...


class LaneView(Protocol):
    """What a scrape reads of the lane consumer (:class:`sidecar.lane.LaneConsumer`)."""

    stats: dict[str, int]

    @property
    def held(self) -> Sized: ...

    @property
    def inflight_batches(self) -> int: ...

    @property
    def saturated(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    def queue_depth(self) -> int: ...


class ScrapedLane(LaneView, Protocol):
    """What the metrics server needs of the lane consumer: the above, its durable and the worker."""

    @property
    def js(self) -> ConsumerInfoSource: ...

    @property
    def stream(self) -> str: ...

    @property
    def durable(self) -> str: ...

    @property
    def link(self) -> WorkerMetricsSource: ...

    @property
    def metrics(self) -> SidecarMetrics: ...


class _LaneState(Collector):
    """Counters and gauges read from the lane consumer at scrape time."""

    def __init__(self, lane: LaneView) -> None:
        self.lane = lane

    def collect(self) -> Iterator[Any]:
        lane = self.lane
        events = CounterMetricFamily(
            "sie_sidecar_deliveries", "Deliveries by what became of them", labels=["event"]
        )
        for event, count in sorted(lane.stats.items()):
            events.add_metric([event], count)
        yield events
        for name, doc, value in (
            ("sie_sidecar_held_messages", "Deliveries held (queued or in a batch)", len(lane.held)),
            ("sie_sidecar_queue_depth", "Deliveries queued for a batch", lane.queue_depth()),
            ("sie_sidecar_inflight_batches", "Batches running on the worker", lane.inflight_batches),
            ("sie_sidecar_saturated", "1 while the worker's batch slots are saturated", int(lane.saturated)),
            ("sie_sidecar_worker_ready", "1 while the worker answers Pings", int(lane.ready)),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g


class SidecarMetrics:
    def __init__(self, pool: str, machine_profile: str, bundle: str) -> None:
        r = self.registry = CollectorRegistry()
        self.lane_labels = (pool, machine_profile, bundle)
        self.queue_wait = Histogram(
            "sie_sidecar_queue_wait_seconds",
            "Time from the gateway's publish to the sidecar's pull",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.redeliveries = Counter(
            "sie_sidecar_redeliveries",
            "Deliveries of a work message (one item or a chunk) after its first",
            registry=r,
        )
        self.batch_size = Histogram(
            "sie_sidecar_batch_size",
            "Items per RunBatch",
            ["model"],
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.run_batch_seconds = Histogram(
            "sie_sidecar_run_batch_seconds",
            "RunBatch round trip over IPC",
            ["model"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.lane_pending = Gauge(
            "sie_sidecar_lane_pending",
            "Messages of the lane durable not yet delivered",
            LANE_LABELS,
            registry=r,
        )
        self.lane_ack_pending = Gauge(
            "sie_sidecar_lane_ack_pending",
            "Messages of the lane durable delivered, not yet settled",
            LANE_LABELS,
            registry=r,
        )
        self.lane_redelivered = Gauge(
            "sie_sidecar_lane_redelivered",
            "Messages of the lane durable being redelivered",
            LANE_LABELS,
            registry=r,
        )
        self.worker_metrics_up = Gauge(
            "sie_sidecar_worker_metrics_up", "1 when the worker answered the last Metrics call", registry=r
        )
        ProcessCollector(namespace="sie_sidecar", registry=r)  # CPU seconds, resident memory

    def watch(self, lane: LaneView) -> None:
        """Read the lane consumer's counters and gauges at every scrape."""
        self.registry.register(_LaneState(lane))

    async def refresh_lane(self, lane: ScrapedLane) -> None:
        """The lane durable's depth from JetStream (left as it was when NATS does not answer)."""
        if not lane.stream or not lane.durable:
            return
        try:
            info = await asyncio.wait_for(
                lane.js.consumer_info(lane.stream, lane.durable), SCRAPE_CALL_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - a scrape never fails for NATS trouble
            log.debug("consumer info for metrics failed: %s", exc)
            return
        self.lane_pending.labels(*self.lane_labels).set(info.num_pending or 0)
        self.lane_ack_pending.labels(*self.lane_labels).set(info.num_ack_pending or 0)
        self.lane_redelivered.labels(*self.lane_labels).set(info.num_redelivered or 0)

    async def worker_text(self, worker: WorkerMetricsSource) -> bytes:
        try:
            text = await worker.metrics_text(SCRAPE_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the sidecar's own metrics are served regardless
            log.debug("worker metrics unavailable: %s", exc)
            self.worker_metrics_up.set(0)
            return b""
        self.worker_metrics_up.set(1)
        return text

    async def render(self, lane: ScrapedLane) -> bytes:
        await self.refresh_lane(lane)
        worker = await self.worker_text(lane.link)
        return generate_latest(self.registry) + worker


async def start_metrics_server(lane: ScrapedLane, host: str, port: int) -> web.AppRunner:
    """Serve ``GET /metrics`` for the pod on ``host:port``; returns the runner to clean up."""

    async def metrics(_: web.Request) -> web.Response:
        body = await lane.metrics.render(lane)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
