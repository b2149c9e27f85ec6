"""The runtime's metrics (worker.metrics) follow what really happened: requests by stage, forward
passes, loads and load failures, evictions, OOM recovery steps, memory."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.api import Item
from protocol.errors import SIEError
from tests.integration.lifecycle.conftest import encode_ready, fake_config

ITEMS = [Item(text=f"item number {i}") for i in range(4)]


def scrape(rt) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(rt.metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(found, name, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_requests_batches_loads_and_evictions_are_counted(make_runtime):
    models = [fake_config(m, memory_bytes=40) for m in ("a", "b", "c")]
    rt = await make_runtime(models, memory_budget_bytes=100)  # two models fit
    await encode_ready(rt, "a", ITEMS)
    await encode_ready(rt, "b", ITEMS)
    await encode_ready(rt, "c", ITEMS)  # evicts a
    found = scrape(rt)
    assert get(found, "sie_worker_loaded_models") == 2
    assert {k[1] for k in found if k[0] == "sie_worker_model_loaded"} == {
        (("model", "b"),),
        (("model", "c"),),
    }
    assert get(found, "sie_worker_evictions_total") == 1
    for model in ("a", "b", "c"):
        assert get(found, "sie_worker_model_load_seconds_count", model=model) == 1
        for stage in ("queue", "tokenization", "inference", "postprocessing"):
            assert get(found, "sie_worker_stage_seconds_count", model=model, stage=stage) >= 1
        assert get(found, "sie_worker_batch_size_sum", model=model) >= len(ITEMS)
    assert get(found, "sie_worker_memory_used_bytes", device=rt.device) == 80
    assert get(found, "sie_worker_memory_total_bytes", device=rt.device) == 100


async def test_load_failures_and_oom_recovery_steps_are_counted(make_runtime):
    models = [
        fake_config("oom", oom_on_batch=2, oom_repeat=1000),
        fake_config("broken", fail_load="no weights"),
    ]
    rt = await make_runtime(models)
    await encode_ready(rt, "oom", ITEMS[:1])
    with pytest.raises(SIEError):
        await rt.encode("oom", ITEMS, direct=True)
    with pytest.raises(SIEError):
        await encode_ready(rt, "broken", ITEMS[:1])
    found = scrape(rt)
    steps = {k[1][1][1]: v for k, v in found.items() if k[0] == "sie_worker_oom_recoveries_total"}
    assert steps == {"oom": 1, "cache_clear": 1, "split": 2, "exhausted": 1}
    assert get(found, "sie_worker_model_load_failures_total", model="broken") >= 1


async def test_forward_seconds_count_the_time_forwards_ran(make_runtime):
    """Each forward's time adds up in sie_worker_forward_seconds_total: a model whose forward sleeps
    20 ms, run as two forwards of two items (max two per batch), counts at least 40 ms; the
    batch-size histogram counts the same two forwards, so time per item is their ratio."""
    rt = await make_runtime([fake_config("slow", batch_delay_ms=20)], max_batch_requests=2)
    await encode_ready(rt, "slow", ITEMS)
    found = scrape(rt)
    forwards = get(found, "sie_worker_batch_size_count", model="slow")
    assert forwards == 2
    assert get(found, "sie_worker_batch_size_sum", model="slow") == len(ITEMS)
    seconds = get(found, "sie_worker_forward_seconds_total", model="slow")
    assert 0.040 <= seconds < 2.0
    assert get(found, "sie_worker_forward_seconds_total", model="other") == 0.0
