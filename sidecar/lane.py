"""The lane consumer: pull, validate, schedule per model, RunBatch over IPC, settle.

Everything here takes its dependencies as arguments (a connected NATS client, an IpcClient, the
settings), so tests run it in-process against a real nats-server and a real worker IPC server.

Settlement:

====================================================  =================================================
situation                                             action
====================================================  =================================================
success / permanent error outcome                     publish WorkResult to reply_subject, then ACK
... when the route names a results subject            the batch's results for it in one message each
                                                      max payload allows (one alone: reply_subject), then ACK
reply publish fails                                   no ACK (redelivered after ack_wait)
reply or results subject not ``_INBOX.``              ACK-drop
no valid routing header                               DLQ copy with the reason, then TERM (leaves the stream)
body the worker cannot decode                         error result INTERNAL_ERROR, DLQ copy, TERM
subject outside the lane                              NAK ``nak_delay_s``
unknown operation                                     error result INVALID_INPUT + ACK
model loading on the worker                           progress-ACK and recheck (no delivery spent)
retry_later, IPC transport error, missing outcome     NAK ``nak_delay_s``
worker draining                                       NAK ``overflow_nak_delay_s`` (100 ms)
over the model's held budget                          NAK 100 ms (kept instead once half the deliveries are spent)
RESOURCE_EXHAUSTED                                    NAK ``oom_nak_delay_s``, nothing published
permanent load failure                                error result MODEL_LOAD_FAILED + ACK
cancelled request                                     ACK-drop
====================================================  =================================================

The consumer is built in layers, one job per module: :mod:`sidecar.lane_state` (shared state) →
:mod:`sidecar.settlement` → :mod:`sidecar.readiness` → :mod:`sidecar.liveness` (leases,
heartbeats) → :mod:`sidecar.scheduling` (per-model batches, RunBatch) → :mod:`sidecar.intake`
(pull, validate, cancel) → :class:`LaneConsumer` (start and stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from protocol import ipc
from protocol.subjects import BULK, INTERACTIVE, WORK_CANCEL_PREFIX
from sidecar.deliveries import Delivery, ModelScheduler
from sidecar.intake import Intake
from sidecar.lane_state import WorkerHealth

log = logging.getLogger("sie.sidecar")

__all__ = ["Delivery", "LaneConsumer", "ModelScheduler", "WorkerHealth"]


class LaneConsumer(Intake):
    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.ipc.on_disconnect = self._worker_lost
        await self.ensure_jetstream()
        self._cancel_sub = await self.nc.subscribe(f"{WORK_CANCEL_PREFIX}.>", cb=self._on_cancel)
        await self.start_pullers()
        self._tasks = [
            asyncio.create_task(self._pull_loop(INTERACTIVE), name="sidecar-pull"),
            asyncio.create_task(self._pull_loop(BULK), name="sidecar-pull-bulk"),
            asyncio.create_task(self._progress_loop(), name="sidecar-progress"),
            asyncio.create_task(self._ping_loop(), name="sidecar-ping"),
            asyncio.create_task(self._heartbeat_loop(), name="sidecar-heartbeat"),
        ]

    def on_reconnect(self) -> None:
        """After a NATS reconnect the open pull requests may have died with the old connection (a
        restarted server has none): open new ones now rather than at their expiry."""
        for puller in self._pullers.values():
            puller.forget()

    async def stop(self, *, drain_timeout_s: float | None = None) -> None:
        """Tombstone heartbeat, stop pulling, Drain the worker, finish in-flight batches, NAK the rest."""
        if self._stop.is_set():
            return
        budget = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.draining = True
        self._stop.set()
        if self.config is not None:
            with contextlib.suppress(Exception):
                await self.config.stop()
        with contextlib.suppress(Exception):
            await self.publish_heartbeat(terminated=True)
            await self.nc.flush(timeout=2)
        await self._cancel_all(self._tasks)
        # Queued items go back at once so another pod can take them.
        for sched in self.schedulers.values():
            for d in sched.take_all():
                await self._nak(d, self.settings.overflow_nak_delay_s)
            sched.wake.set()
        with contextlib.suppress(Exception):
            await self.ipc.call(ipc.DRAIN, {"deadline_ms": int(budget * 1000)}, timeout_s=budget + 1)
        if self._batch_tasks:
            await asyncio.wait(list(self._batch_tasks), timeout=budget)
        await self._cancel_all([sched.task for sched in self.schedulers.values() if sched.task])
        for d in list(self.held):
            await self._nak(d, self.settings.overflow_nak_delay_s)
        for puller in self._pullers.values():
            with contextlib.suppress(Exception):
                await puller.stop()
        if self._cancel_sub is not None:
            with contextlib.suppress(Exception):
                await self._cancel_sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)

    @staticmethod
    async def _cancel_all(tasks: list[asyncio.Task]) -> None:
        """Cancel and wait, bounded: on Python 3.11 ``wait_for`` can swallow a cancel that races with
        a result, so every loop also checks the stop flag and this wait never hangs shutdown."""
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
