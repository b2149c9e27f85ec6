"""Prometheus metrics of the standalone server (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sie_worker_requests_total", "Requests by endpoint and status", ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sie_worker_request_latency_seconds", "Request latency", ["endpoint"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.items = Counter("sie_worker_items_total", "Items processed", ["endpoint"], registry=self.registry)
        self.loaded_models = Gauge("sie_worker_loaded_models", "Models loaded", registry=self.registry)
        self.queue_depth = Gauge("sie_worker_queue_depth", "Units waiting in batchers", registry=self.registry)
        self.forwards = Gauge("sie_worker_forward_passes", "Forward passes run", registry=self.registry)
        self.real_tokens = Gauge("sie_worker_batch_tokens", "Real tokens in forward passes", registry=self.registry)
        self.padded_tokens = Gauge(
            "sie_worker_batch_padded_tokens", "Pad positions added to forward passes", registry=self.registry
        )

    def render(self, runtime) -> bytes:
        stats = runtime.batch_stats()
        self.loaded_models.set(len(runtime.loaded_models()))
        self.queue_depth.set(runtime.queue_depth())
        self.forwards.set(stats.forwards)
        self.real_tokens.set(stats.real_tokens)
        self.padded_tokens.set(stats.padded_tokens)
        return generate_latest(self.registry)
