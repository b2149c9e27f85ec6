"""Prometheus metrics of the config service (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ConfigMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.epoch = Gauge("sie_config_epoch", "Config epoch seen by this replica", registry=r)
        self.models = Gauge("sie_config_models_total", "Models known, by source", ["source"], registry=r)
        self.bundles = Gauge(
            "sie_config_bundles_total", "Bundles loaded from the bundles directory", registry=r
        )
        self.writer = Gauge(
            "sie_config_writer", "1 when this replica holds the single-writer lock", registry=r
        )
        self.nats_connected = Gauge(
            "sie_config_nats_connected", "1 when the delta publisher is connected", registry=r
        )
        self.publishes = Counter(
            "sie_config_nats_publishes_total", "Delta publications by outcome", ["result"], registry=r
        )
        self.store_writes = Counter(
            "sie_config_store_writes_total",
            "Store writes by operation and outcome",
            ["op", "result"],
            registry=r,
        )
        self.requests = Counter(
            "sie_config_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "sie_config_http_request_duration_seconds",
            "HTTP request duration",
            ["method", "route"],
            registry=r,
        )
