"""Whether the worker can run a model: Pings on an interval, and EnsureModelReady per model.

:class:`Readiness` sees the worker through :class:`ReadinessCalls` (Ping, EnsureModelReady) and
settles what cannot run through :class:`ReadinessSettler`; it tells whoever runs its Ping loop that
readiness changed through the ``announce`` callback given to :meth:`Readiness.ping_loop`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from protocol import ipc
from protocol.clock import Clock
from protocol.errors import ErrorCode
from protocol.work import WorkResult
from sidecar.deliveries import Delivery, Lease, ModelScheduler, leases_of
from sidecar.ipc_client import IpcRemoteError, IpcTransportError
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar")


class WorkerHealth:
    """What the last Pings said about the worker."""

    def __init__(self) -> None:
        self.last_ok: float | None = None  # the lane's clock (protocol.clock)
        self.ping: ipc.PingResponse = ipc.PingResponse()
        # the pinned models of the pools this worker serves, as the gateways last said (sie.pin.<id>);
        # None until one has: the worker keeps what it has
        self.pinned: list[str] | None = None

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.last_ok is not None and now - self.last_ok <= stale_after_s

    def take_pins(self, data: bytes) -> bool:
        """A gateway's ``{"models": [...]}`` on ``sie.pin.<worker id>``: the pinned models the next
        Pings carry. False (and nothing changes) for anything else."""
        try:
            models = json.loads(data).get("models")
        except (ValueError, AttributeError):
            return False
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            return False
        self.pinned = models
        return True

    def forget(self) -> None:
        """The worker is gone: nothing it said holds any more."""
        self.last_ok = None
        self.ping = ipc.PingResponse()


class ReadinessCalls(Protocol):
    """The worker's IPC methods readiness uses (:class:`sidecar.worker_link.WorkerLink`)."""

    @property
    def generation(self) -> int: ...

    async def ping(self, timeout_s: float, pinned: list[str] | None = None) -> ipc.PingResponse: ...

    async def ensure_model_ready(self, spec: str, timeout_s: float) -> ipc.EnsureModelReadyResponse: ...


class ReadinessSettler(Protocol):
    """How readiness settles the items of a model that cannot run (:class:`sidecar.settlement.Settlement`)."""

    def error_result(self, d: Delivery, code: str, message: str) -> WorkResult: ...

    async def publish_and_ack(
        self, d: Delivery, result: WorkResult | bytes, *, success: bool = False
    ) -> None: ...

    async def nak(self, d: Delivery, delay_s: float) -> None: ...

    async def progress(self, lease: Lease) -> None: ...


class Readiness:
    def __init__(
        self,
        worker: ReadinessCalls,
        settings: SidecarSettings,
        health: WorkerHealth,
        settlement: ReadinessSettler,
        stopping: asyncio.Event,
        clock: Clock,
    ) -> None:
        self.worker = worker
        self.settings = settings
        self.health = health
        self.settlement = settlement
        self.stopping = stopping  # set once the lane stops: not ready from then on
        self.clock = clock
        self.stale_after_s = settings.worker_ping_interval_ms / 1000.0 * settings.worker_readyz_stale_mult

    def fresh(self) -> bool:
        """Whether the worker answered a Ping lately (it is there, ready or not)."""
        return self.health.fresh(self.clock.now(), self.stale_after_s)

    @property
    def ready(self) -> bool:
        """What the heartbeat says: not stopping, the worker there and ready for work."""
        return not self.stopping.is_set() and self.fresh() and bool(self.health.ping.ready)

    def transport_nak_delay(self) -> float:
        """NAK delay after an IPC transport error. When the worker is gone this pod stops pulling, so
        the items go to other pods (or wait in the stream for this worker): just long enough for the
        pull request in flight to expire, so that they are not delivered straight back to it."""
        if self.health.last_ok is None or not self.fresh():
            return self.settings.nats_fetch_timeout_s + 0.25
        return self.settings.nak_delay_s

    async def ping_loop(self, announce: Callable[[], Awaitable[None]]) -> None:
        """Ping the worker every ``worker_ping_interval_ms``; while it is gone, every 0.2 s, so that
        work resumes (and the heartbeat says ready) as soon as it answers again. ``announce`` runs
        whenever that makes :attr:`ready` change."""
        interval = self.settings.worker_ping_interval_ms / 1000.0
        failures = 0
        while not self.stopping.is_set():
            was_ready = self.ready
            try:
                self.health.ping = await self.worker.ping(
                    timeout_s=max(1.0, interval), pinned=self.health.pinned
                )
                self.health.last_ok = self.clock.now()
                if failures:
                    log.info("worker answers Ping again after %d failed Ping(s)", failures)
                failures = 0
            except (IpcTransportError, IpcRemoteError) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("worker Ping failed (%d in a row): %s", failures, exc)
            if self.ready != was_ready:
                await announce()
            await self.clock.wait(
                self.stopping, interval if self.health.last_ok is not None else min(interval, 0.2)
            )

    async def ensure_ready(self, sched: ModelScheduler) -> bool:
        """EnsureModelReady for a scheduler with pending items; settles them when it cannot become ready."""
        s = self.settings
        try:
            resp = await self.worker.ensure_model_ready(sched.spec, timeout_s=s.model_ready_timeout_s)
        except (IpcTransportError, IpcRemoteError) as exc:
            log.warning("EnsureModelReady(%s) failed: %s", sched.spec, exc)
            if exc.code == ipc.IPC_DRAINING:
                delay = s.overflow_nak_delay_s
            elif isinstance(exc, IpcTransportError):
                delay = self.transport_nak_delay()
            else:
                delay = s.nak_delay_s
            for d in sched.take_all():
                await self.settlement.nak(d, delay)
            sched.ready = False
            return False
        if resp.state == ipc.STATE_READY:
            sched.generation = self.worker.generation
            sched.ready = True
            sched.limits.max_cost = (
                s.batcher_max_batch_cost or resp.max_batch_tokens or s.batcher_default_batch_cost
            )
            sched.limits.max_requests = min(
                s.batcher_max_batch_requests, resp.batch_budget or s.batcher_max_batch_requests
            )
            sched.depth = resp.forwards_in_flight or 0
            sched.concurrent_forwards = resp.forward_lanes or 1
            return True
        sched.ready = False
        if resp.state in (ipc.STATE_LOADING_STARTED, ipc.STATE_LOADING_IN_PROGRESS):
            for lease in leases_of(sched.pending()):
                await self.settlement.progress(lease)
            base = s.model_loading_recheck_s * (1 if resp.state == ipc.STATE_LOADING_STARTED else 2)
            await self.clock.wait(self.stopping, min(base, s.loading_recheck_cap_s))
            return False
        if resp.state == ipc.STATE_FAILED:
            code = resp.error_code or ErrorCode.MODEL_LOAD_FAILED
            message = resp.error or f"model {sched.spec} failed to load"
            for d in sched.take_all():
                await self.settlement.publish_and_ack(d, self.settlement.error_result(d, code, message))
            return False
        # retry_later
        delay = s.overflow_nak_delay_s if resp.error_code == ipc.IPC_DRAINING else s.nak_delay_s
        for d in sched.take_all():
            await self.settlement.nak(d, delay)
        return False
