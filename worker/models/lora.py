"""LoRA adapters of one loaded model: an LRU of at most ``max_loras`` (``SIE_MAX_LORAS_PER_MODEL``).

A request naming a LoRA that is not loaded starts its load and is answered ``503 LORA_LOADING``
with ``Retry-After`` (``SIE_LORA_LOADING_RETRY_AFTER_S``); concurrent requests for it share that
one load. A load resolves the source (a local directory, or a hub id through the weight cache
tiers) on a loader thread, then injects the adapter on one of the model's forward threads while
no forward runs, so it never races a forward pass. A failed load answers ``500 INFERENCE_ERROR``
until ``SIE_LOAD_FAILURE_COOLDOWN_S`` has passed, then the next request tries again.

Past ``max_loras`` the least recently used LoRA that no queued request is using is unloaded (if
every one is in use, the set stays over the cap until the next load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from protocol.errors import ErrorCode, SIEError
from worker.adapters.base import Adapter

log = logging.getLogger(__name__)

ResolveFn = Callable[[str], Path]
OnInferenceThread = Callable[..., Awaitable[Any]]


class LoraSet:
    def __init__(
        self,
        model_id: str,
        adapter: Adapter,
        *,
        max_loras: int,
        resolve: ResolveFn,
        resolve_pool: Executor,
        on_inference_thread: OnInferenceThread,
        retry_after_s: float = 1.0,
        failure_cooldown_s: float = 30.0,
    ) -> None:
        self.model_id = model_id
        self.adapter = adapter
        self.max_loras = max_loras
        self.resolve = resolve
        self.resolve_pool = resolve_pool
        self.on_inference_thread = on_inference_thread
        self.retry_after_s = retry_after_s
        self.failure_cooldown_s = failure_cooldown_s
        self.loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.loading: dict[str, asyncio.Task[None]] = {}
        self.failed: dict[str, tuple[SIEError, float]] = {}
        self.evicted: list[str] = []
        self._in_use: Counter[str] = Counter()

    def ensure(self, name: str) -> None:
        """Return when ``name`` is loaded (and mark it used); else start its load and raise."""
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return
        failure = self.failed.get(name)
        if failure is not None:
            error, failed_at = failure
            if time.monotonic() - failed_at < self.failure_cooldown_s:
                raise error
            del self.failed[name]
        if name not in self.loading:
            self.loading[name] = asyncio.get_running_loop().create_task(self._load(name), name=f"lora:{name}")
        raise SIEError(
            ErrorCode.LORA_LOADING,
            f"LoRA '{name}' is loading for model '{self.model_id}'; retry shortly",
            retry_after=self.retry_after_s,
        )

    @contextlib.contextmanager
    def use(self, name: str | None) -> Iterator[None]:
        """Hold ``name`` while a request's batches are queued or running: it is not evicted meanwhile."""
        if name is None:
            yield
            return
        self._in_use[name] += 1
        try:
            yield
        finally:
            self._in_use[name] -= 1
            if not self._in_use[name]:
                del self._in_use[name]

    async def wait(self, name: str) -> None:
        """Until a load of ``name`` in progress has finished (tests, preloading)."""
        task = self.loading.get(name)
        if task is not None:
            await asyncio.shield(task)

    def close(self) -> None:
        for task in self.loading.values():
            task.cancel()
        self.loading.clear()
        self.loaded.clear()

    async def _load(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            path = await loop.run_in_executor(self.resolve_pool, self.resolve, name)
            await self.on_inference_thread(self.adapter.load_lora, name, str(path))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = SIEError(
                ErrorCode.INFERENCE_ERROR, f"LoRA '{name}' failed to load for model '{self.model_id}': {exc}"
            )
            self.failed[name] = (error, time.monotonic())
            log.error("%s", error.message)
            return
        finally:
            self.loading.pop(name, None)
        self.loaded[name] = None
        log.info("loaded LoRA %s on %s in %.1f s", name, self.model_id, time.monotonic() - started)
        await self._trim(keep=name)

    async def _trim(self, keep: str) -> None:
        while len(self.loaded) > self.max_loras:
            victim = next((n for n in self.loaded if n != keep and not self._in_use.get(n)), None)
            if victim is None:
                return
            del self.loaded[victim]
            self.evicted.append(victim)
            await self.on_inference_thread(self.adapter.unload_lora, victim)
            log.info("unloaded LoRA %s from %s (more than %d loaded)", victim, self.model_id, self.max_loras)
