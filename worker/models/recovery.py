"""Out-of-memory recovery on an inference lane: clear caches, evict a sibling, split the batch."""

from __future__ import annotations

import logging
from typing import Any

from protocol.errors import ErrorCode, SIEError
from worker.adapters.base import Prepared, RequestContext, is_oom
from worker.models.loaded import LoadedModel
from worker.models.registry import ModelStates

log = logging.getLogger("worker.runtime")


MAX_SPLIT_DEPTH = 4


class OomRecovery(ModelStates):
    def forward_with_recovery(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """Inference thread: forward; on OOM clear caches, evict a sibling, split; then give up.

        Each step taken is recorded in ``recovery_events`` as (model, step): ``oom``,
        ``cache_clear``, ``evict_sibling``, ``split``, ``exhausted``.
        """
        if lm.closed:
            raise SIEError(
                ErrorCode.MODEL_LOADING,
                f"Model '{lm.model_id}' was unloaded; retry",
                retry_after=self.settings.model_loading_retry_after_s,
            )
        try:
            return lm.adapter.forward(ctx, units)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._recovery(lm, "oom")
            if self.settings.disable_oom_recovery:
                raise self._exhausted(lm) from exc
        log.warning("OOM in %s on a batch of %d; recovering", lm.model_id, len(units))
        self._recovery(lm, "cache_clear")
        self._clear_device_cache()
        try:
            return lm.adapter.forward(ctx, units)
        except Exception as exc:
            if not is_oom(exc):
                raise
        if self._evict_sibling(lm):
            self._recovery(lm, "evict_sibling")
            try:
                return lm.adapter.forward(ctx, units)
            except Exception as exc:
                if not is_oom(exc):
                    raise
        return self._split(lm, ctx, units, 1)

    def _recovery(self, lm: LoadedModel, step: str) -> None:
        self.recovery_events.append((lm.model_id, step))
        self.metrics.oom_recoveries.labels(lm.model_id, step).inc()

    def _split(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared], depth: int) -> list[Any]:
        """Halve the batch recursively (at most MAX_SPLIT_DEPTH levels) until the halves fit."""
        if len(units) < 2 or depth > MAX_SPLIT_DEPTH:
            self._recovery(lm, "exhausted")
            raise self._exhausted(lm)
        self._recovery(lm, "split")
        half = len(units) // 2
        out = []
        for part in (units[:half], units[half:]):
            try:
                out.extend(lm.adapter.forward(ctx, part))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self._clear_device_cache()
                out.extend(self._split(lm, ctx, part, depth + 1))
        return out

    def _exhausted(self, lm: LoadedModel) -> SIEError:
        return SIEError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"Out of memory running '{lm.model_id}' after recovery; retry later",
            retry_after=self.settings.resource_exhausted_retry_after_s,
        )
