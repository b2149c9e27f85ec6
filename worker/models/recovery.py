"""Out-of-memory recovery on a forward thread: clear caches, evict a sibling, split the batch."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from protocol.errors import ErrorCode, SIEError
from worker.adapters.base import Prepared, RequestContext, is_oom
from worker.metrics import WorkerMetrics
from worker.models.loaded import LoadedModel
from worker.settings import WorkerSettings

log = logging.getLogger("worker.runtime")


MAX_SPLIT_DEPTH = 4


class Siblings(Protocol):
    """Memory to be had from other models (:class:`worker.models.memory.SiblingEviction`)."""

    def evict_for(self, keep: LoadedModel) -> bool:
        """From a forward thread: unload another model so ``keep`` fits; whether one went."""
        ...


class OomRecovery:
    """The forward pass of every loaded model (:data:`worker.models.loaded.ForwardFn`).

    Each step taken is recorded in ``events`` as (model, step): ``oom``, ``cache_clear``,
    ``evict_sibling``, ``split``, ``exhausted``, and counted in ``sie_worker_oom_recoveries``.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        *,
        siblings: Siblings,
        clear_cache: Callable[[], None],
    ) -> None:
        self.enabled = not settings.disable_oom_recovery
        self.unloaded_retry_after_s = settings.model_loading_retry_after_s
        self.exhausted_retry_after_s = settings.resource_exhausted_retry_after_s
        self.metrics = metrics
        self.siblings = siblings
        self.clear_cache = clear_cache
        self.events: deque[tuple[str, str]] = deque(maxlen=256)

    def forward(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """Inference thread: forward; on OOM clear caches, evict a sibling, split; then give up."""
        if lm.closed:
            raise SIEError(
                ErrorCode.MODEL_LOADING,
                f"Model '{lm.model_id}' was unloaded; retry",
                retry_after=self.unloaded_retry_after_s,
            )
        try:
            return lm.adapter.forward(ctx, units)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._record(lm, "oom")
            if not self.enabled:
                raise self._exhausted(lm) from exc
        log.warning("OOM in %s on a batch of %d; recovering", lm.model_id, len(units))
        self._record(lm, "cache_clear")
        self.clear_cache()
        try:
            return lm.adapter.forward(ctx, units)
        except Exception as exc:
            if not is_oom(exc):
                raise
        if self.siblings.evict_for(lm):
            self._record(lm, "evict_sibling")
            try:
                return lm.adapter.forward(ctx, units)
            except Exception as exc:
                if not is_oom(exc):
                    raise
        return self._split(lm, ctx, units, 1)

    def _record(self, lm: LoadedModel, step: str) -> None:
        self.events.append((lm.model_id, step))
        self.metrics.oom_recoveries.labels(lm.model_id, step).inc()

    def _split(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared], depth: int) -> list[Any]:
        """Halve the batch recursively (at most MAX_SPLIT_DEPTH levels) until the halves fit."""
        if len(units) < 2 or depth > MAX_SPLIT_DEPTH:
            self._record(lm, "exhausted")
            raise self._exhausted(lm)
        self._record(lm, "split")
        half = len(units) // 2
        out: list[Any] = []
        for part in (units[:half], units[half:]):
            try:
                out.extend(lm.adapter.forward(ctx, part))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self.clear_cache()
                out.extend(self._split(lm, ctx, part, depth + 1))
        return out

    def _exhausted(self, lm: LoadedModel) -> SIEError:
        return SIEError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"Out of memory running '{lm.model_id}' after recovery; retry later",
            retry_after=self.exhausted_retry_after_s,
        )
