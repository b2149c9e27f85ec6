"""Where each model's weights are, kept fresh for ``GET /v1/models`` (its ``weights`` field).

A :class:`~worker.models.weights.WeightsReport` is checked every ``weights_check_interval_s``, and
at once when the control plane changes a model config (:meth:`WeightsWatch.recheck`). A check makes
network probes (one short hub request, one cluster-cache listing), so it runs in a thread; nothing
is downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from protocol import weights as weights_vocab
from protocol.model_config import ModelConfig
from worker.models.weights import WeightsReport

log = logging.getLogger("worker.runtime")


class WeightsWatch:
    def __init__(
        self, report: WeightsReport, models: Callable[[], Iterable[ModelConfig]], *, interval_s: float
    ) -> None:
        """``models``: the catalog's current models; ``interval_s``: 0 = never checked (``unknown``)."""
        self.report = report
        self.models = models
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._recheck = asyncio.Event()

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="weights-check")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._recheck.clear()
            try:
                await loop.run_in_executor(None, self.report.check, list(self.models()))
            except Exception:  # noqa: BLE001 - a report, never worth the worker
                log.exception("checking where the weights are failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), self.interval_s)

    def recheck(self) -> None:
        """A model config changed: check now rather than at the next interval."""
        self._recheck.set()

    def status(self) -> dict[str, str]:
        """Model id → where its weights are (:mod:`protocol.weights`); ``unknown`` until checked."""
        latest = self.report.latest
        return {m.sie_id: latest.get(m.sie_id, weights_vocab.UNKNOWN) for m in self.models()}
