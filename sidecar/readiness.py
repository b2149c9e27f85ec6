"""Whether the worker can run a model: Pings on an interval, and EnsureModelReady per model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from protocol import ipc
from protocol.errors import ErrorCode
from sidecar.deliveries import ModelScheduler
from sidecar.ipc_client import IpcRemoteError, IpcTransportError
from sidecar.settlement import Settlement

log = logging.getLogger("sie.sidecar")


class Readiness(Settlement):
    def _worker_stale_after_s(self) -> float:
        return self.settings.worker_ping_interval_ms / 1000.0 * self.settings.worker_readyz_stale_mult

    async def _ping_loop(self) -> None:
        interval = self.settings.worker_ping_interval_ms / 1000.0
        failures = 0
        while not self._stop.is_set():
            try:
                body = await self.ipc.call(
                    ipc.PING, {"timestamp_ms": int(time.time() * 1000)}, timeout_s=max(1.0, interval)
                )
                self.worker.ping = ipc.PingResponse.from_map(body)
                self.worker.last_ok = time.monotonic()
                failures = 0
            except (IpcTransportError, IpcRemoteError) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("worker Ping failed (%d in a row): %s", failures, exc)
            await asyncio.sleep(interval)

    @property
    def ready(self) -> bool:
        return (
            not self.draining
            and self.worker.fresh(self._worker_stale_after_s())
            and bool(self.worker.ping.ready)
        )

    async def _ensure_ready(self, sched: ModelScheduler) -> bool:
        """EnsureModelReady for a scheduler with pending items; settles them when it cannot become ready."""
        s = self.settings
        try:
            body = await self.ipc.call(
                ipc.ENSURE_MODEL_READY, {"model_id": sched.spec}, timeout_s=s.model_ready_timeout_s
            )
            resp = ipc.EnsureModelReadyResponse.from_map(body)
        except (IpcTransportError, IpcRemoteError) as exc:
            log.warning("EnsureModelReady(%s) failed: %s", sched.spec, exc)
            delay = s.overflow_nak_delay_s if ipc.DRAINING_ERROR in str(exc) else s.nak_delay_s
            for d in sched.take_all():
                await self._nak(d, delay)
            sched.ready = False
            return False
        if resp.state == ipc.STATE_READY:
            sched.generation = self.ipc.generation
            sched.ready = True
            sched.limits.max_cost = (
                s.batcher_max_batch_cost or resp.max_batch_tokens or s.batcher_default_batch_cost
            )
            sched.limits.max_requests = min(
                s.batcher_max_batch_requests, resp.batch_budget or s.batcher_max_batch_requests
            )
            return True
        sched.ready = False
        if resp.state in (ipc.STATE_LOADING_STARTED, ipc.STATE_LOADING_IN_PROGRESS):
            for d in sched.pending():
                await self._progress(d)
            base = s.model_loading_recheck_s * (1 if resp.state == ipc.STATE_LOADING_STARTED else 2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), min(base, s.loading_recheck_cap_s))
            return False
        if resp.state == ipc.STATE_FAILED:
            code = resp.error_code or ErrorCode.MODEL_LOAD_FAILED
            message = resp.error or f"model {sched.spec} failed to load"
            for d in sched.take_all():
                await self._publish_and_ack(d, self._error_result(d, code, message))
            return False
        # retry_later
        delay = s.overflow_nak_delay_s if resp.error == ipc.DRAINING_ERROR else s.nak_delay_s
        for d in sched.take_all():
            await self._nak(d, delay)
        return False
