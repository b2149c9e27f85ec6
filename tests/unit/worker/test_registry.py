"""ModelRegistry alone, over fake models: the load state machine, what the sidecar is told, stale
entries after a config change."""

from __future__ import annotations

import pytest

from protocol.catalog import Catalog
from protocol.errors import ErrorCode, SIEError
from tests.support.worker_parts import CPU, direct_forward, fake_config, settings
from worker.metrics import WorkerMetrics
from worker.models.loop_bridge import LoopBridge
from worker.models.memory import MemoryManager, MemoryUsage
from worker.models.registry import ModelRegistry
from worker.models.table import ModelTable
from worker.models.weights import WeightCache


@pytest.fixture
async def make(tmp_path):
    made: list[ModelRegistry] = []

    async def build(*configs, **kw) -> ModelRegistry:
        s = settings(disk_cache_dir=str(tmp_path / "cache"), **kw)
        table = ModelTable(retry_after_s=s.model_loading_retry_after_s, clear_cache=lambda: None)
        registry = ModelRegistry(
            s,
            Catalog(list(configs)),
            placement=CPU,
            table=table,
            memory=MemoryManager(MemoryUsage("cpu", 10**9, table.loaded), table.loaded, table.evict),
            weights=WeightCache.from_settings(s),
            loop=LoopBridge(),
            metrics=WorkerMetrics(),
            forward=direct_forward,
        )
        await registry.start()
        made.append(registry)
        return registry

    yield build
    for registry in made:
        await registry.close()


async def loaded(registry: ModelRegistry, spec: str):
    resolved = registry.catalog.resolve(spec)
    with pytest.raises(SIEError) as err:
        await registry.ready_model(resolved)
    assert err.value.code == ErrorCode.MODEL_LOADING
    task = registry.entry(resolved).task
    assert task is not None
    await task
    return await registry.ready_model(resolved)


async def test_the_first_request_starts_the_load_and_is_told_to_retry(make):
    registry = await make(fake_config("m"), model_loading_retry_after_s=6)
    resolved = registry.catalog.resolve("m")
    with pytest.raises(SIEError) as err:
        await registry.ready_model(resolved)
    assert err.value.retry_after == 6
    assert registry.loading_models() == ["m"] and registry.model_state("m") == ("loading", None)
    await registry.entry(resolved).task
    lm = await registry.ready_model(resolved)
    assert lm.model_id == "m" and registry.loaded() == [lm]
    assert registry.loaded_models() == ["m"] and registry.profile_states() == {"m": ("loaded", None)}


async def test_a_failed_load_is_a_permanent_answer(make):
    registry = await make(fake_config("bad", fail_load="no weights"))
    resolved = registry.catalog.resolve("bad")
    with pytest.raises(SIEError):
        await registry.ready_model(resolved)
    await registry.entry(resolved).task
    with pytest.raises(SIEError) as err:
        await registry.ready_model(resolved)
    assert err.value.code == ErrorCode.MODEL_LOAD_FAILED and "no weights" in err.value.message
    state, error = registry.model_state("bad")
    assert state == "failed" and error is not None and error["code"] == ErrorCode.MODEL_LOAD_FAILED
    assert (await registry.ensure_ready("bad")).state == "failed"


async def test_ensure_ready_tells_the_sidecar_each_state_and_the_batch_limits(make):
    registry = await make(fake_config("m"), max_batch_requests=16)
    first = await registry.ensure_ready("m")
    assert first.state == "loading_started" and first.error is not None
    assert (await registry.ensure_ready("m")).state == "loading_in_progress"
    await registry.entry(registry.catalog.resolve("m")).task
    ready = await registry.ensure_ready("m")
    assert (ready.state, ready.error, ready.max_batch_tokens, ready.max_batch_requests) == (
        "ready",
        None,
        4096,
        16,
    )
    assert (await registry.ensure_ready("unknown")).state == "failed"


async def test_a_changed_config_drops_the_stale_instance(make):
    registry = await make(fake_config("m"), fake_config("other"))
    await loaded(registry, "m")
    await loaded(registry, "other")
    await registry.drop_stale("m")  # nothing changed
    assert registry.loaded_models() == ["m", "other"]
    registry.catalog.put(fake_config("m", memory_bytes=5))
    await registry.drop_stale("m")
    assert registry.loaded_models() == ["other"] and registry.model_state("m") == ("available", None)


async def test_preloaded_models_are_loaded_when_start_returns(make):
    registry = await make(fake_config("m"), fake_config("n"), preload_models="m")
    assert registry.loaded_models() == ["m"]
    assert registry.weight_keys() == {"m--main"}  # its weights stay in the disk cache
