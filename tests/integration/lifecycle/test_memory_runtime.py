"""The memory manager wired into the runtime: fake models with a footprint, a synthetic budget.

SIE_MEMORY_BUDGET_BYTES makes the device: usage = the loaded adapters' memory_bytes(), which the
fake adapter takes from its load-time ``memory_bytes`` option.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from protocol.api import Item
from protocol.errors import ErrorCode, SIEError
from tests.integration.lifecycle.conftest import encode_ready, fake_config

ITEMS = [Item(text=f"item number {i}") for i in range(4)]


async def test_loading_a_third_model_evicts_the_least_recently_used(make_runtime):
    models = [fake_config(m, memory_bytes=40) for m in ("a", "b", "c")]
    rt = await make_runtime(models, memory_budget_bytes=100)  # 85 % of 100: two models fit
    await encode_ready(rt, "a", ITEMS)
    await encode_ready(rt, "b", ITEMS)
    assert rt.loaded_models() == ["a", "b"]
    await encode_ready(rt, "c", ITEMS)
    assert rt.loaded_models() == ["b", "c"]
    assert [k[0] for k in rt.memory.evicted] == ["a"]
    # use b, so c becomes the least recently used; loading a again evicts c
    await encode_ready(rt, "b", ITEMS)
    await encode_ready(rt, "a", ITEMS)
    assert rt.loaded_models() == ["a", "b"]
    assert [k[0] for k in rt.memory.evicted] == ["a", "c"]
    assert rt.model_state("c") == ("available", None)


async def test_a_larger_model_is_preferred_under_pressure(make_runtime):
    models = [
        fake_config("small", memory_bytes=10),
        fake_config("large", memory_bytes=50),
        fake_config("new", memory_bytes=40),
    ]
    rt = await make_runtime(models, memory_budget_bytes=100)
    await encode_ready(rt, "small", ITEMS)  # the least recently used, but evicting it frees too little
    await encode_ready(rt, "large", ITEMS)
    await encode_ready(rt, "new", ITEMS)  # 100 of 100 used: 15 bytes must go
    assert rt.loaded_models() == ["new", "small"]
    assert [k[0] for k in rt.memory.evicted] == ["large"]


async def test_the_only_loaded_model_is_never_evicted(make_runtime):
    rt = await make_runtime(
        [fake_config("huge", memory_bytes=500)], memory_budget_bytes=100, memory_monitor_interval_s=0.01
    )
    await encode_ready(rt, "huge", ITEMS)
    ticks = rt.memory.ticks
    while rt.memory.ticks < ticks + 3:  # three monitor passes under pressure
        await asyncio.sleep(0.01)
    assert rt.memory.under_pressure()
    assert rt.loaded_models() == ["huge"]
    assert rt.memory.evicted == []


async def test_the_monitor_evicts_when_pressure_appears(make_runtime):
    models = [fake_config(m, memory_bytes=40) for m in ("a", "b")]
    rt = await make_runtime(models, memory_budget_bytes=100, memory_monitor_interval_s=0.01)
    await encode_ready(rt, "a", ITEMS)
    await encode_ready(rt, "b", ITEMS)
    assert rt.loaded_models() == ["a", "b"]
    rt.memory.usage.budget_bytes = 80  # the device shrinks under the runtime (another tenant)
    ticks = rt.memory.ticks
    while rt.memory.ticks < ticks + 2:
        await asyncio.sleep(0.01)
    assert rt.loaded_models() == ["b"]


async def test_monitor_interval_zero_means_no_monitor(make_runtime):
    rt = await make_runtime([fake_config("a")], memory_monitor_interval_s=0)
    assert rt.models.monitor is None
    rt2 = await make_runtime([fake_config("a")], memory_monitor_interval_s=5)
    assert rt2.models.monitor is not None and not rt2.models.monitor.done()


@pytest.mark.parametrize("threshold,loaded", [(95.0, ["a", "b", "c"]), (85.0, ["b", "c"])])
async def test_memory_pressure_threshold_setting(make_runtime, threshold, loaded):
    models = [
        fake_config("a", memory_bytes=40),
        fake_config("b", memory_bytes=40),
        fake_config("c", memory_bytes=15),
    ]
    rt = await make_runtime(models, memory_budget_bytes=100, memory_pressure_threshold_percent=threshold)
    for m in ("a", "b", "c"):
        await encode_ready(rt, m, ITEMS)
    assert rt.loaded_models() == loaded  # 95 % used: above 85, not above 95


async def test_without_a_budget_usage_is_host_memory(make_runtime):
    rt = await make_runtime([fake_config("a")], memory_budget_bytes=0)
    used, total = rt.memory_usage()
    assert total > 1_000_000 and 0 < used < total  # the machine (or its cgroup), not the fake's 1 MB


# ---- OOM during a batch --------------------------------------------------------------------
def events(rt, model):
    return [step for m, step in rt.recovery_events if m == model]


async def oom_runtime(make_runtime, oom_repeat, *, sibling=True, **kw):
    models = [
        fake_config("oom", oom_on_batch=2, oom_repeat=oom_repeat),
        fake_config("sib"),
        fake_config("clean"),
    ]
    rt = await make_runtime(models, **kw)
    await encode_ready(rt, "oom", ITEMS[:1])  # dispatch 1 loads it; faults start at dispatch 2
    if sibling:
        await encode_ready(rt, "sib", ITEMS[:1])
    return rt


async def test_oom_cache_clear_then_sibling_then_split_then_resource_exhausted(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=1000, resource_exhausted_retry_after_s=7)
    with pytest.raises(SIEError) as err:
        await rt.encode("oom", ITEMS, direct=True)
    assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert err.value.status == 503
    assert err.value.retry_after == 7
    assert events(rt, "oom") == ["oom", "cache_clear", "evict_sibling", "split", "split", "exhausted"]
    assert rt.loaded_models() == ["oom"]  # the sibling went; the model itself stays loaded
    assert [k[0] for k in rt.memory.evicted] == ["sib"]


async def test_oom_recovered_by_clearing_the_cache(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=1)
    res = await rt.encode("oom", ITEMS, direct=True)
    assert events(rt, "oom") == ["oom", "cache_clear"]
    assert rt.loaded_models() == ["oom", "sib"]
    assert len(res.items) == 4


async def test_oom_recovered_by_evicting_a_sibling(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=2)
    await rt.encode("oom", ITEMS, direct=True)
    assert events(rt, "oom") == ["oom", "cache_clear", "evict_sibling"]
    assert rt.loaded_models() == ["oom"]


async def test_oom_recovered_by_splitting_gives_the_same_vectors(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=3)
    res = await rt.encode("oom", ITEMS, direct=True)
    assert events(rt, "oom") == ["oom", "cache_clear", "evict_sibling", "split"]
    ref = await encode_ready(rt, "clean", ITEMS)
    for got, want in zip(res.items, ref.items, strict=True):
        np.testing.assert_array_equal(got["dense"]["values"], want["dense"]["values"])


async def test_oom_without_a_sibling_skips_to_the_split(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=2, sibling=False)
    await rt.encode("oom", ITEMS, direct=True)
    assert events(rt, "oom") == ["oom", "cache_clear", "split"]


async def test_disable_oom_recovery_answers_resource_exhausted_at_once(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=1, disable_oom_recovery=True)
    with pytest.raises(SIEError) as err:
        await rt.encode("oom", ITEMS, direct=True)
    assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert events(rt, "oom") == ["oom"]
    assert rt.loaded_models() == ["oom", "sib"]


async def test_oom_through_the_batcher_is_the_same(make_runtime):
    rt = await oom_runtime(make_runtime, oom_repeat=1000)
    with pytest.raises(SIEError) as err:
        await rt.encode("oom", ITEMS, direct=False)
    assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert events(rt, "oom")[:3] == ["oom", "cache_clear", "evict_sibling"]
    assert events(rt, "oom")[-1] == "exhausted"


async def test_an_unloaded_model_is_collected_though_loads_freeze_the_heap(make_runtime):
    """A load freezes the heap (``gc.freeze``: full collections stop walking the loaded model); an
    unload unfreezes it, so the unloaded model, which its LoRA set holds in a reference cycle, is
    collected rather than kept for good."""
    import gc
    import weakref

    models = [fake_config(m, memory_bytes=40) for m in ("a", "b", "c")]
    rt = await make_runtime(models, memory_budget_bytes=100)
    await encode_ready(rt, "a", ITEMS)
    assert gc.get_freeze_count() > 0
    first = weakref.ref(rt.loaded()[0])
    await encode_ready(rt, "b", ITEMS)
    await encode_ready(rt, "c", ITEMS)  # a is evicted
    assert rt.loaded_models() == ["b", "c"]
    gc.collect()
    assert first() is None
