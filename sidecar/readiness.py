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
        """Ping the worker every ``worker_ping_interval_ms``; while it is gone, every 0.2 s, so that
        work resumes (and the heartbeat says ready) as soon as it answers again."""
        interval = self.settings.worker_ping_interval_ms / 1000.0
        failures = 0
        while not self._stop.is_set():
            was_ready = self.ready
            try:
                body = await self.ipc.call(
                    ipc.PING, {"timestamp_ms": int(time.time() * 1000)}, timeout_s=max(1.0, interval)
                )
                self.worker.ping = ipc.PingResponse.from_map(body)
                self.worker.last_ok = time.monotonic()
                if failures:
                    log.info("worker answers Ping again after %d failed Ping(s)", failures)
                failures = 0
            except (IpcTransportError, IpcRemoteError) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("worker Ping failed (%d in a row): %s", failures, exc)
            if self.ready != was_ready:
                await self._announce()
            await asyncio.sleep(interval if self.worker.last_ok is not None else min(interval, 0.2))

    async def publish_heartbeat(self, *, terminated: bool = False) -> None:
        raise NotImplementedError  # sidecar.liveness, the layer above, publishes heartbeats

    async def _announce(self) -> None:
        """A heartbeat now (readiness changed), besides the periodic ones."""
        try:
            await self.publish_heartbeat()
        except Exception as exc:  # noqa: BLE001 - heartbeats are best effort
            log.debug("heartbeat publish failed: %s", exc)

    def _worker_lost(self, reason: str) -> None:
        """The IPC connection closed (the worker died or restarts): not ready at once, stop pulling,
        and give back every queued item now (in-flight batches fail with the connection and NAK
        theirs), instead of holding them until Pings go stale and leases run out."""
        if self._stop.is_set():
            return
        log.warning(
            "worker connection lost (%s): not ready, returning %d held item(s)", reason, len(self.held)
        )
        self.worker.last_ok = None
        self.worker.ping = ipc.PingResponse()
        for sched in self.schedulers.values():
            sched.ready = False
        task = asyncio.get_running_loop().create_task(self._give_back_queued())
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _give_back_queued(self) -> None:
        await self._announce()
        for sched in self.schedulers.values():
            for d in sched.take_all():
                await self._nak(d, self._transport_nak_delay())
            sched.wake.set()

    def _transport_nak_delay(self) -> float:
        """NAK delay after an IPC transport error. When the worker is gone this pod stops pulling, so
        the items go to other pods (or wait in the stream for this worker): just long enough for the
        pull request in flight to expire, so that they are not delivered straight back to it."""
        if self.worker.last_ok is None or not self.worker.fresh(self._worker_stale_after_s()):
            return self.settings.nats_fetch_timeout_s + 0.25
        return self.settings.nak_delay_s

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
            if exc.code == ipc.IPC_DRAINING:
                delay = s.overflow_nak_delay_s
            elif isinstance(exc, IpcTransportError):
                delay = self._transport_nak_delay()
            else:
                delay = s.nak_delay_s
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
            sched.depth = resp.forwards_in_flight or 0
            sched.lanes = resp.forward_lanes or 1
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
        delay = s.overflow_nak_delay_s if resp.error_code == ipc.IPC_DRAINING else s.nak_delay_s
        for d in sched.take_all():
            await self._nak(d, delay)
        return False
