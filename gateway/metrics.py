"""Prometheus metrics of one gateway (own registry, so several gateways can live in one process)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.pool_spec import DEFAULT_POOL
from gateway.routing import Lane


@functools.lru_cache(maxsize=1024)
def labelled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, memoised for the per-request metrics: prometheus_client converts
    and checks the values and takes a lock on every call (1.8 against 0.5 us with the ``inc``), and
    a request asks for the same few children every time. Not for a metric whose children are
    removed (``clear``, ``remove``): the memo would hand out a detached child."""
    return metric.labels(*values)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "sie_gateway_requests", "HTTP requests", ["endpoint", "status", "machine_profile"], registry=r
        )
        self.latency = Histogram(
            "sie_gateway_request_latency_seconds", "Request latency", ["endpoint"], registry=r
        )
        self.provisioning = Counter(
            "sie_gateway_provisioning_responses", "Provisioning answers", ["machine_profile"], registry=r
        )
        self.rejected = Counter(
            "sie_gateway_rejected_requests",
            "Rejected requests",
            ["machine_profile", "bundle", "reason"],
            registry=r,
        )
        self.pending_demand = Gauge(
            "sie_gateway_pending_demand",
            "1 while requests for a (machine_profile, bundle) lane found no capacity",
            ["machine_profile", "bundle"],
            registry=r,
        )
        self.workers = Gauge("sie_gateway_workers", "Known workers", ["status"], registry=r)
        self.worker_queue_depth = Gauge(
            "sie_gateway_worker_queue_depth",
            "Queue depth reported by a worker heartbeat",
            ["worker", "machine_profile", "bundle"],
            registry=r,
        )
        self.items_published = Counter(
            "sie_gateway_queue_items_published", "Work items published", ["operation"], registry=r
        )
        self.publish_seconds = Histogram(
            "sie_gateway_queue_publish_seconds", "Publish time per request", ["operation"], registry=r
        )
        self.result_wait_seconds = Histogram(
            "sie_gateway_queue_result_wait_seconds", "Wait for results", ["operation"], registry=r
        )
        self.direct_items = Counter(
            "sie_gateway_queue_direct_items",
            "Work items sent to a lane's sidecars on core NATS while its stream or durable had no leader",
            ["priority"],
            registry=r,
        )
        self.inbox_skips = Counter(
            "sie_gateway_queue_inbox_skips", "Results for unknown or finished requests", registry=r
        )
        self.cache_lookups = Counter(
            "sie_gateway_result_cache_lookups", "Result cache lookups per item", ["result"], registry=r
        )
        self.cache_followed = Counter(
            "sie_gateway_result_cache_followed",
            "Result cache misses that waited for an equal one a concurrent request was computing",
            registry=r,
        )
        self.cache_stores = Counter(
            "sie_gateway_result_cache_stores", "Results written to the cache", registry=r
        )
        self.cache_errors = Counter(
            "sie_gateway_result_cache_errors", "Result cache reads/writes that failed", ["kind"], registry=r
        )
        self.priority_items = Counter(
            "sie_gateway_priority_items", "Work items published per priority class", ["priority"], registry=r
        )
        self.payload_offloads = Counter(
            "sie_gateway_queue_payload_offloads",
            "Work items over the NATS max payload, sent through the payload store",
            registry=r,
        )
        self.cancels = Counter("sie_gateway_work_cancels", "work_cancel publishes", ["reason"], registry=r)
        self.dlq_events = Counter(
            "sie_gateway_dlq_events", "Max-delivery advisories forwarded", ["stream", "consumer"], registry=r
        )
        self.dlq_failures = Counter(
            "sie_gateway_dlq_republish_failures", "DLQ forwards that failed", registry=r
        )
        self.pool_events = Counter("sie_gateway_pool_events", "Pool lifecycle", ["event"], registry=r)
        self.active_lease_gpus = Gauge(
            "sie_gateway_active_lease_gpus", "GPUs requested by live pools", ["machine_profile"], registry=r
        )
        self.nats_connected = Gauge("sie_gateway_nats_connected", "1 while NATS is connected", registry=r)
        self.config_epoch = Gauge(
            "sie_gateway_config_epoch", "Config epoch of the gateway's model registry", registry=r
        )
        self.config_deltas = Counter(
            "sie_gateway_config_deltas",
            "Config deltas received on sie.config.models._all",
            ["kind", "result"],
            registry=r,
        )
        self.config_bootstrap_failures = Counter(
            "sie_gateway_config_bootstrap_failures", "Failed config exports/polls", registry=r
        )
        self.config_bootstrap_degraded = Gauge(
            "sie_gateway_config_bootstrap_degraded",
            "1 while the first config bootstrap keeps failing (10 attempts or 5 min)",
            registry=r,
        )
        # seed families with zeros so autoscaler queries never see "no data"
        self.pending_demand.labels("", "").set(0)
        for result in ("hit", "miss"):
            self.cache_lookups.labels(result).inc(0)
        for status in ("healthy", "unhealthy"):
            self.workers.labels(status).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class DemandTracker:
    """Pending demand per lane (pool, machine_profile, bundle): set on a miss, expires after
    ``expiry_s``. The gauge keeps the reference's labels (machine_profile, bundle) and reads 1 while
    any pool has demand for them; the scaler reads the lanes themselves, so it wakes only the pool
    that was asked for."""

    def __init__(
        self, metrics: GatewayMetrics, expiry_s: float = 120.0, clock: Callable[[], float] = time.monotonic
    ):
        self.metrics = metrics
        self.expiry_s = expiry_s
        self._clock = clock
        self._until: dict[Lane, float] = {}

    def record(self, machine_profile: str, bundle: str, pool: str = DEFAULT_POOL) -> None:
        lane = Lane(pool.lower(), machine_profile.lower(), bundle.lower())
        self._until[lane] = self._clock() + self.expiry_s
        self.metrics.pending_demand.labels(lane.machine_profile, lane.bundle).set(1)

    def clear(self, machine_profile: str, bundle: str, pool: str | None = None) -> None:
        """Forget the demand of ``(machine_profile, bundle)`` in ``pool`` (None: in every pool)."""
        profile, bundle = machine_profile.lower(), bundle.lower()
        gone = [
            lane
            for lane in self._until
            if lane.machine_profile == profile and lane.bundle == bundle and pool in (None, lane.pool)
        ]
        for lane in gone:
            del self._until[lane]
        if gone and not any(
            lane.machine_profile == profile and lane.bundle == bundle for lane in self._until
        ):
            self.metrics.pending_demand.labels(profile, bundle).set(0)

    def pending(self) -> dict[Lane, float]:
        return dict(self._until)

    def refresh(self, fulfilled: Callable[[Lane], bool] | None = None) -> None:
        """Expire old entries and clear those a healthy worker now serves."""
        now = self._clock()
        for lane, until in list(self._until.items()):
            if until <= now or (fulfilled is not None and fulfilled(lane)):
                self.clear(lane.machine_profile, lane.bundle, lane.pool)
