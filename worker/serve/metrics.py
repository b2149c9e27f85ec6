"""Prometheus metrics of the standalone server: its HTTP requests, plus the runtime's own
(:mod:`worker.metrics`). One registry per app, so tests can run several."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

if TYPE_CHECKING:
    from worker.runtime import Runtime


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sie_worker_requests_total",
            "Requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sie_worker_request_latency_seconds",
            "Request latency",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.cache_lookups = Counter(
            "sie_worker_result_cache_lookups",
            "Result cache lookups per encode item",
            ["result"],
            registry=self.registry,
        )

    def render(self, runtime: Runtime) -> bytes:
        return bytes(generate_latest(self.registry)) + runtime.metrics.render()
