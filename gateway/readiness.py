"""What the health routes read of this gateway: whether it is ready for requests, its NATS
connection, and its metrics with their gauges brought up to date."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.admission import Admission
from gateway.metrics import DemandTracker, GatewayMetrics
from gateway.routing import Lane
from gateway.workers import WorkerRegistry


class Readiness:
    def __init__(
        self,
        admission: Admission,
        workers: WorkerRegistry,
        *,
        connected: Callable[[], bool],
        config_ready: Callable[[], bool],
        listening_since: Callable[[], float | None],
        warmup_s: float,
    ) -> None:
        self.admission = admission
        self.workers = workers
        self._connected = connected
        self._config_ready = config_ready
        self._listening_since = listening_since  # time.monotonic() it began to hear heartbeats
        self.warmup_s = warmup_s

    def nats_connected(self) -> bool:
        return self._connected()

    def not_ready(self) -> str | None:
        """Why this gateway should get no requests now (None: it is ready)."""
        if self.admission.draining:
            return "draining"
        if not self._config_ready():
            return "config bootstrap pending"
        if not self._connected():
            return "NATS disconnected"
        # a new replica has heard no heartbeat yet and would answer PROVISIONING for live lanes
        since = self._listening_since()
        if since is None or time.monotonic() - since < self.warmup_s:
            return "worker registry warming up"
        return None

    def healthy_workers(self) -> int:
        return len(self.workers.healthy())


class MetricsPage:
    """``/metrics``: the gauges that are read rather than counted, set, then every metric rendered."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        demand: DemandTracker,
        workers: WorkerRegistry,
        *,
        lane_served: Callable[[Lane], bool],
        connected: Callable[[], bool],
    ) -> None:
        self.metrics = metrics
        self.demand = demand
        self.workers = workers
        self._lane_served = lane_served
        self._connected = connected

    def render(self) -> bytes:
        m = self.metrics
        self.demand.refresh(self._lane_served)
        m.nats_connected.set(1 if self._connected() else 0)
        healthy = self.workers.healthy()
        m.workers.labels("healthy").set(len(healthy))
        m.workers.labels("unhealthy").set(len(self.workers.all()) - len(healthy))
        m.worker_queue_depth.clear()
        for w in healthy:
            m.worker_queue_depth.labels(w.worker_id, w.profile, w.bundle).set(w.heartbeat.queue_depth)
        return m.render()
