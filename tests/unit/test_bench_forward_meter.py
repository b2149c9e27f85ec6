"""The cluster benchmark's forward columns read the names the worker really exports."""

from __future__ import annotations

from tests.benchmarks.run import forward_totals
from worker.runtime import Runtime
from worker.settings import WorkerSettings


def test_forward_totals_read_one_models_forward_time_and_items_from_a_workers_metrics():
    metrics = Runtime(WorkerSettings()).metrics
    metrics.forward_seconds.labels("m").inc(0.25)
    metrics.forward_seconds.labels("m").inc(0.5)
    metrics.observe_batch("m", 3, 0, 0)
    metrics.observe_batch("m", 5, 0, 0)
    metrics.forward_seconds.labels("other").inc(9.0)
    metrics.observe_batch("other", 64, 0, 0)
    text = metrics.render().decode()
    assert forward_totals(text, "m") == (0.75, 8.0)
    assert forward_totals(text, "absent") == (0.0, 0.0)
