"""Prometheus metrics of the model runtime, the same in both front doors.

``sie serve`` renders them on its ``/metrics``; in the cluster the worker answers the IPC ``Metrics``
method with them and the sidecar serves them on the pod's metrics port. One registry per runtime, so
tests can run several. Live events (a request's stages, a forward pass, a model load, an OOM
recovery step) are observed where they happen; state (loaded models, queue depth, memory,
evictions) is read from the runtime when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from worker.batching.former import BatchStats

STAGES = ("queue", "tokenization", "inference", "postprocessing")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SHARE_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
_LOAD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RuntimeState(Protocol):
    """What the metrics read from the runtime when scraped (:class:`worker.runtime.Runtime`)."""

    @property
    def device(self) -> str: ...

    def loaded_models(self) -> list[str]: ...

    def queue_depth(self) -> int: ...

    def batch_stats(self) -> BatchStats: ...

    def memory_usage(self) -> tuple[int, int]: ...

    def evictions(self) -> int: ...


class _RuntimeState(Collector):
    """Gauges and counters read from the runtime at scrape time."""

    def __init__(self, runtime: RuntimeState) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Any]:
        rt = self.runtime
        loaded = GaugeMetricFamily("sie_worker_loaded_models", "Models loaded")
        loaded.add_metric([], len(rt.loaded_models()))
        yield loaded
        per_model = GaugeMetricFamily("sie_worker_model_loaded", "1 per loaded model", labels=["model"])
        for model in rt.loaded_models():
            per_model.add_metric([model], 1)
        yield per_model
        depth = GaugeMetricFamily("sie_worker_queue_depth", "Units waiting in batchers")
        depth.add_metric([], rt.queue_depth())
        yield depth
        stats = rt.batch_stats()
        for name, doc, value in (
            ("sie_worker_forward_passes", "Forward passes run by the loaded models", stats.forwards),
            (
                "sie_worker_batch_tokens",
                "Real tokens in forward passes of the loaded models",
                stats.real_tokens,
            ),
            ("sie_worker_batch_padded_tokens", "Pad positions added to forward passes", stats.padded_tokens),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        used, total = rt.memory_usage()
        mem = GaugeMetricFamily("sie_worker_memory_used_bytes", "Device memory in use", labels=["device"])
        mem.add_metric([rt.device], used)
        yield mem
        cap = GaugeMetricFamily("sie_worker_memory_total_bytes", "Device memory in all", labels=["device"])
        cap.add_metric([rt.device], total)
        yield cap
        evictions = CounterMetricFamily("sie_worker_evictions", "Models evicted under memory pressure")
        evictions.add_metric([], rt.evictions())
        yield evictions


class WorkerMetrics:
    """Live events are observed by the parts where they happen; ``watch`` adds the state read at scrape
    time, once the runtime that holds it exists."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.stage_seconds = Histogram(
            "sie_worker_stage_seconds",
            "Time of a request in each worker stage (queue, tokenization, inference, postprocessing)",
            ["model", "stage"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.batch_size = Histogram(
            "sie_worker_batch_size", "Items per forward pass", ["model"], registry=r, buckets=_SIZE_BUCKETS
        )
        self.forward_seconds = Counter(
            "sie_worker_forward_seconds",
            "Time the model's forward threads spent in forward passes (OOM recovery included); with "
            "sie_worker_batch_size, the forward time per item and the share of time a forward thread computes",
            ["model"],
            registry=r,
        )
        self.tokens_per_batch = Histogram(
            "sie_worker_tokens_per_batch",
            "Real tokens per forward pass",
            ["model"],
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.padding_share = Histogram(
            "sie_worker_padding_share",
            "Share of pad positions in a forward pass",
            ["model"],
            registry=r,
            buckets=_SHARE_BUCKETS,
        )
        self.model_load_seconds = Histogram(
            "sie_worker_model_load_seconds",
            "Time to load a model",
            ["model"],
            registry=r,
            buckets=_LOAD_BUCKETS,
        )
        self.model_load_failures = Counter(
            "sie_worker_model_load_failures", "Model loads that failed", ["model"], registry=r
        )
        self.idle_unloads = Counter(
            "sie_worker_idle_unloads",
            "Models unloaded after SIE_MODEL_IDLE_TIMEOUT_S without a request",
            ["model"],
            registry=r,
        )
        self.preemptions = Counter(
            "sie_worker_preemptions",
            "Interactive batches run inside a running bulk forward, between two of its layers (CPU)",
            ["model"],
            registry=r,
        )
        self.oom_recoveries = Counter(
            "sie_worker_oom_recoveries",
            "OOM recovery steps (oom, cache_clear, evict_sibling, split, exhausted)",
            ["model", "step"],
            registry=r,
        )
        ProcessCollector(namespace="sie_worker", registry=r)  # CPU seconds, resident memory

    def watch(self, runtime: RuntimeState) -> None:
        self.registry.register(_RuntimeState(runtime))

    def observe_request(self, model: str, timing: Any) -> None:
        for stage in STAGES:
            self.stage_seconds.labels(model, stage).observe(getattr(timing, f"{stage}_ms") / 1000.0)

    def observe_batch(self, model: str, size: int, real_tokens: int, padded_tokens: int) -> None:
        self.batch_size.labels(model).observe(size)
        if real_tokens or padded_tokens:
            self.tokens_per_batch.labels(model).observe(real_tokens)
            self.padding_share.labels(model).observe(padded_tokens / (real_tokens + padded_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
