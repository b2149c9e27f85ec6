"""The memory manager: loaded models form an LRU; under memory pressure the manager evicts some.

The manager knows nothing about devices or the runtime. It takes three functions:

- ``usage()`` → ``(used_bytes, total_bytes)`` of the device the models live on,
- ``loaded()`` → the resident models (objects with ``key``, ``last_used`` and ``memory_bytes()``),
- ``evict(key)`` → an awaitable that unloads one of them,

so tests can run it against plain objects, and the runtime against CUDA, host memory or a
synthetic budget (``SIE_MEMORY_BUDGET_BYTES``).

Pressure means ``used + required > threshold% · total``. While under pressure the manager evicts
one model at a time and probes again. Which one: the least recently used model whose footprint
alone ends the pressure; when none would, the largest one (it gets closest, so fewer models are
evicted). A ``keep`` model (the one being loaded or being run) is never evicted, and without one
the last resident model never is: it would only be loaded again by the next request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long an OOM recovery waits for an eviction already in progress before giving up on it
EVICT_LOCK_TIMEOUT_S = 10.0


class Resident(Protocol):
    @property
    def key(self) -> Hashable: ...

    @property
    def last_used(self) -> int | float: ...

    def memory_bytes(self) -> int: ...


UsageFn = Callable[[], tuple[int, int]]
LoadedFn = Callable[[], Sequence[Resident]]
EvictFn = Callable[[Hashable], Awaitable[object]]


def pick_victim(candidates: Sequence[Resident], needed: float) -> Resident:
    """The LRU candidate that frees ``needed`` bytes alone, else the largest (ties: the LRU one)."""
    by_age = sorted(candidates, key=lambda m: m.last_used)
    for model in by_age:
        if model.memory_bytes() >= needed:
            return model
    return max(by_age, key=lambda m: m.memory_bytes())  # max keeps the first (oldest) of equals


class MemoryManager:
    def __init__(
        self, usage: UsageFn, loaded: LoadedFn, evict: EvictFn, *, threshold_percent: float = 85.0
    ) -> None:
        self.usage = usage
        self.loaded = loaded
        self.evict = evict
        self.threshold_percent = threshold_percent
        self.evicted: list[Hashable] = []  # every key evicted, in order (metrics and tests)
        self.ticks = 0  # monitor passes completed
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def over_by(self, required_bytes: int = 0) -> float:
        """Bytes above the threshold (> 0 means pressure), counting ``required_bytes`` still to load."""
        used, total = self.usage()
        if total <= 0:
            return 0.0
        return used + required_bytes - total * self.threshold_percent / 100.0

    def under_pressure(self, required_bytes: int = 0) -> bool:
        return self.over_by(required_bytes) > 0

    async def relieve(self, required_bytes: int = 0, keep: Hashable | None = None) -> list[Hashable]:
        """Evict until the pressure (counting ``required_bytes``) ends or nothing may go."""
        async with self.lock:
            evicted: list[Hashable] = []
            while True:
                needed = self.over_by(required_bytes)
                if needed <= 0:
                    break
                resident = list(self.loaded())
                candidates = [m for m in resident if m.key != keep]
                if not candidates or (keep is None and len(resident) <= 1):
                    break
                victim = pick_victim(candidates, needed)
                used, total = self.usage()
                log.warning(
                    "memory pressure (%.1f%% used, threshold %.0f%%): evicting %s (%d bytes)",
                    100.0 * (used + required_bytes) / total,
                    self.threshold_percent,
                    _name(victim.key),
                    victim.memory_bytes(),
                )
                await self.evict(victim.key)
                self.evicted.append(victim.key)
                evicted.append(victim.key)
            return evicted

    async def evict_lru(
        self, keep: Hashable, lock_timeout_s: float = EVICT_LOCK_TIMEOUT_S
    ) -> Hashable | None:
        """OOM recovery: evict the least recently used model other than ``keep``, pressure or not."""
        try:
            await asyncio.wait_for(self.lock.acquire(), lock_timeout_s)
        except TimeoutError:
            log.warning("OOM recovery: another eviction holds the lock; not evicting a sibling")
            return None
        try:
            others = [m for m in self.loaded() if m.key != keep]
            if not others:
                return None
            victim = min(others, key=lambda m: m.last_used)
            await self.evict(victim.key)
            self.evicted.append(victim.key)
            return victim.key
        finally:
            self.lock.release()

    async def monitor(self, interval_s: float) -> None:
        """Background task: relieve pressure every ``interval_s`` seconds."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.relieve()
            except Exception:
                log.exception("memory monitor pass failed")
            self.ticks += 1


def _name(key: Hashable) -> str:
    return str(key[0]) if isinstance(key, tuple) and key else str(key)


class MemoryUsage:
    """The ``usage()`` of a worker: with a synthetic budget (``SIE_MEMORY_BUDGET_BYTES``) the resident
    models' own ``memory_bytes()`` against it, else the CUDA device's or the host's memory."""

    def __init__(self, device: str, budget_bytes: int, loaded: LoadedFn) -> None:
        self.device = device
        self.budget_bytes = budget_bytes
        self.loaded = loaded

    def __call__(self) -> tuple[int, int]:
        if self.budget_bytes > 0:
            return sum(m.memory_bytes() for m in self.loaded()), self.budget_bytes
        if self.device.startswith("cuda"):
            return cuda_usage(self.device)
        return host_usage()


class RunOnLoop(Protocol):
    """:class:`worker.models.loop_bridge.LoopBridge`"""

    @property
    def bound(self) -> bool: ...

    def run(self, coro: Coroutine[Any, Any, T]) -> T: ...


class SiblingEviction:
    """OOM recovery's way to memory (:class:`worker.models.recovery.Siblings`): from an inference
    forward thread, have the manager evict the least recently used model other than the one that ran out."""

    def __init__(self, memory: MemoryManager, loop: RunOnLoop) -> None:
        self.memory = memory
        self.loop = loop

    def evict_for(self, keep: Resident) -> bool:
        if not self.loop.bound:
            return False
        try:
            victim = self.loop.run(self.memory.evict_lru(keep=keep.key))
        except Exception:
            log.exception("evicting a sibling of %s failed", _name(keep.key))
            return False
        if victim is None:
            return False
        log.warning("evicted %s to recover from OOM in %s", _name(victim), _name(keep.key))
        return True


# ---- usage probes ----------------------------------------------------------------------------
def cuda_usage(device: str) -> tuple[int, int]:
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free, total


def host_usage() -> tuple[int, int]:
    """Host memory as the process sees it: the cgroup (v2 or v1) limit when one is set, else the machine."""
    cgroup = _cgroup_usage()
    if cgroup is not None:
        return cgroup
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024
    except OSError:
        info = {}
    if "MemTotal" in info and "MemAvailable" in info:
        return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    return total - page * os.sysconf("SC_AVPHYS_PAGES"), total


def _cgroup_usage() -> tuple[int, int] | None:
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            used = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60):
            return used, int(limit)
    return None
