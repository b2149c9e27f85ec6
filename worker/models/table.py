"""The worker's model entries, one per load signature, and unloading.

The table is what the memory manager sees (``loaded``, ``evict``), so it sits below both the registry
that loads models into it (:mod:`worker.models.registry`) and the OOM recovery that asks the memory
manager to evict from it (:mod:`worker.models.recovery`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import cast

from protocol import heap
from protocol.catalog import Resolved
from protocol.errors import ErrorCode, SIEError
from worker.models.loaded import LoadedModel, ModelEntry, ModelKey, load_signature

log = logging.getLogger("worker.runtime")


class ModelTable:
    def __init__(self, *, retry_after_s: float, clear_cache: Callable[[], None]) -> None:
        """``retry_after_s``: what requests queued for an unloaded model are told; ``clear_cache``:
        hands freed memory back (the device's caches) after an unload."""
        self.retry_after_s = retry_after_s
        self.clear_cache = clear_cache
        self._entries: dict[ModelKey, ModelEntry] = {}
        self.pinned: set[ModelKey] = set()  # loaded and kept: never evicted, never unloaded when idle

    def entry(self, resolved: Resolved) -> ModelEntry:
        """The entry of ``resolved``'s load signature, created absent on first sight."""
        key = load_signature(resolved)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = ModelEntry(key, resolved.model_id)
        return entry

    def get(self, key: ModelKey) -> ModelEntry | None:
        return self._entries.get(key)

    def entries(self) -> list[ModelEntry]:
        """A snapshot (the load and LoRA threads read it while the loop adds entries)."""
        return list(self._entries.values())

    def loaded(self) -> list[LoadedModel]:
        return [e.loaded for e in self.entries() if e.loaded is not None]

    def evictable(self) -> list[LoadedModel]:
        """The loaded models the memory manager may evict: all but the pinned ones."""
        return [lm for lm in self.loaded() if lm.key not in self.pinned]

    def forget(self, key: ModelKey) -> None:
        self._entries.pop(key, None)

    async def evict(self, key: Hashable) -> None:
        """The memory manager's eviction: unload the entry under ``key``, if loaded."""
        entry = self.get(cast(ModelKey, key)) if isinstance(key, tuple) else None
        if entry is not None and entry.loaded is not None:
            await self.unload(entry)

    async def unload(self, entry: ModelEntry) -> None:
        lm = entry.loaded
        if lm is None:
            return
        entry.loaded = None
        entry.state = "absent"
        await lm.close(
            SIEError(
                ErrorCode.MODEL_LOADING,
                f"Model '{lm.model_id}' was unloaded; retry",
                retry_after=self.retry_after_s,
            )
        )
        heap.unfreeze()  # loads freeze the heap: the model's objects must be visible to the collector
        self.clear_cache()
        log.info("unloaded %s", lm.model_id)
