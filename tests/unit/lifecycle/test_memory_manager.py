"""The memory manager on its own: plain resident records, a usage probe over them, a real evict."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from worker.models.loop_bridge import LoopBridge
from worker.models.memory import MemoryManager, MemoryUsage, SiblingEviction, host_usage, pick_victim


@dataclass
class Model:
    key: str
    size: int
    last_used: int

    def memory_bytes(self) -> int:
        return self.size


class Device:
    """Resident models on a device of ``total`` bytes; evict removes one."""

    def __init__(self, total: int, *models: Model) -> None:
        self.total = total
        self.models = list(models)

    def usage(self) -> tuple[int, int]:
        return sum(m.size for m in self.models), self.total

    def loaded(self) -> list[Model]:
        return list(self.models)

    async def evict(self, key: str) -> None:
        self.models = [m for m in self.models if m.key != key]

    def manager(self, threshold: float = 85.0) -> MemoryManager:
        return MemoryManager(self.usage, self.loaded, self.evict, threshold_percent=threshold)

    def keys(self) -> list[str]:
        return [m.key for m in self.models]


def test_pick_victim_lru_that_suffices_else_largest():
    a, b, c = Model("a", 10, 1), Model("b", 50, 2), Model("c", 40, 3)
    assert pick_victim([a, b, c], needed=5).key == "a"  # the LRU frees enough alone
    assert pick_victim([a, b, c], needed=15).key == "b"  # the LRU does not: the LRU of those that do
    assert pick_victim([a, b, c], needed=45).key == "b"  # only b does
    assert pick_victim([a, b, c], needed=100).key == "b"  # none does: the largest
    same = [Model("x", 10, 5), Model("y", 10, 2), Model("z", 10, 9)]
    assert pick_victim(same, needed=50).key == "y"  # equal sizes: the least recently used


async def test_no_pressure_no_eviction():
    dev = Device(100, Model("a", 40, 1), Model("b", 45, 2))  # 85 % exactly is not above the threshold
    assert await dev.manager().relieve() == []
    assert dev.keys() == ["a", "b"]


async def test_pressure_evicts_lru_until_below_threshold():
    dev = Device(100, Model("a", 30, 1), Model("b", 30, 2), Model("c", 30, 3))
    mgr = dev.manager()
    assert await mgr.relieve() == ["a"]
    assert dev.keys() == ["b", "c"]
    assert mgr.evicted == ["a"]


async def test_larger_model_preferred_under_pressure():
    # 100 used of 100, threshold 85: 15 bytes must go; the LRU (10) is not enough, b (50) is
    dev = Device(100, Model("a", 10, 1), Model("b", 50, 2), Model("c", 40, 3))
    assert await dev.manager().relieve() == ["b"]
    assert dev.keys() == ["a", "c"]


async def test_required_bytes_count_as_pressure_and_keep_is_never_evicted():
    dev = Device(100, Model("a", 40, 1), Model("b", 40, 2))
    mgr = dev.manager()
    # loading "new" (30 bytes, not resident yet): 110 > 85 → evict; "a" is LRU and enough
    assert await mgr.relieve(required_bytes=30, keep="new") == ["a"]
    # keep protects a resident model even when it is the LRU
    dev = Device(100, Model("a", 60, 1), Model("b", 40, 2))
    assert await dev.manager().relieve(keep="a") == ["b"]
    assert dev.keys() == ["a"]


async def test_only_loaded_model_never_evicted():
    dev = Device(100, Model("a", 99, 1))
    mgr = dev.manager()
    assert await mgr.relieve() == []
    assert dev.keys() == ["a"]
    # with several resident, eviction stops at the last one even if still under pressure
    dev = Device(100, Model("a", 90, 1), Model("b", 95, 2))
    assert await dev.manager().relieve() == ["b"]  # the LRU (a) alone is not enough: the largest
    assert dev.keys() == ["a"]


async def test_but_a_load_may_replace_the_only_model():
    dev = Device(100, Model("a", 80, 1))
    assert await dev.manager().relieve(required_bytes=50, keep="b") == ["a"]


@pytest.mark.parametrize("threshold,expected", [(95.0, []), (85.0, ["a"]), (50.0, ["a", "b"])])
async def test_threshold_setting(threshold, expected):
    dev = Device(100, Model("a", 30, 1), Model("b", 30, 2), Model("c", 30, 3))  # 90 % used
    assert await dev.manager(threshold).relieve() == expected


async def test_evict_lru_for_oom_ignores_pressure_and_spares_keep():
    dev = Device(1000, Model("a", 10, 3), Model("b", 10, 1), Model("c", 10, 2))
    mgr = dev.manager()
    assert await mgr.evict_lru(keep="b") == "c"
    assert await mgr.evict_lru(keep="b") == "a"
    assert await mgr.evict_lru(keep="b") is None
    assert dev.keys() == ["b"]


async def test_evict_lru_gives_up_when_the_lock_is_held():
    dev = Device(1000, Model("a", 10, 1), Model("b", 10, 2))
    mgr = dev.manager()
    async with mgr.lock:
        assert await mgr.evict_lru(keep="b", lock_timeout_s=0.01) is None
    assert dev.keys() == ["a", "b"]


async def test_monitor_relieves_pressure_in_the_background():
    dev = Device(100, Model("a", 50, 1), Model("b", 50, 2))
    mgr = dev.manager()
    task = asyncio.create_task(mgr.monitor(0.01))
    try:
        while mgr.ticks < 2:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert dev.keys() == ["b"]
    assert mgr.evicted == ["a"]


def test_host_usage_is_a_plausible_fraction():
    used, total = host_usage()
    assert 0 < used <= total


def test_a_budget_counts_the_resident_models_against_it():
    dev = Device(100, Model("a", 40, 1), Model("b", 45, 2))
    assert MemoryUsage("cpu", 500, dev.loaded)() == (85, 500)
    used, total = MemoryUsage("cpu", 0, dev.loaded)()  # no budget: the host
    assert total > 1_000_000 and 0 < used < total


async def test_sibling_eviction_runs_on_the_loop_from_a_lane_thread():
    dev = Device(100, Model("a", 40, 1), Model("b", 45, 2), Model("c", 5, 3))
    bridge = LoopBridge()
    siblings = SiblingEviction(dev.manager(), bridge)
    assert not siblings.evict_for(Model("c", 5, 3))  # not bound to a loop yet: nothing to do
    bridge.bind()
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, siblings.evict_for, Model("c", 5, 3))
    assert dev.keys() == ["b", "c"]  # the least recently used other model went
    alone = Device(100, Model("c", 5, 3))
    assert not await loop.run_in_executor(
        None, SiblingEviction(alone.manager(), bridge).evict_for, alone.models[0]
    )
