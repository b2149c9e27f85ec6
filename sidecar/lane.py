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

The consumer is composed of parts, each a plain class that takes its collaborators in
``__init__`` (each typed by a ``Protocol`` in the part's module) and can be built and tested alone:

==============================  ===============================================================
part                            job
==============================  ===============================================================
``intake.Intake``               pull requests on the lane's two durables, validate the routing
                                header, hand each delivery to the scheduler; cancellations
``scheduling.Scheduler``        per-model batchers by operation, group key and priority; RunBatch
``readiness.Readiness``         Pings; EnsureModelReady per model
``liveness.Liveness``           progress-ACK leases; heartbeats
``settlement.Settlement``       publish results; ACK, NAK, TERM; DLQ copies
``worker_link.WorkerLink``      every IPC call to the worker, typed
==============================  ===============================================================

They share three plain objects: the :class:`~sidecar.deliveries.Held` set, the counters
(``stats``) and the ``stopping`` event; time comes from one :class:`~protocol.clock.Clock`.
:class:`LaneConsumer` builds them, wires the parts and owns start and stop. A lane is one JetStream
route: pool, machine profile and bundle (:func:`protocol.subjects.lane_prefix`), with an
interactive and a bulk durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iokit.payloads import PayloadStore
from protocol.clock import Clock, MonotonicClock
from protocol.subjects import BULK, HEALTH_SOLICIT, INTERACTIVE
from sidecar.barrier import ExecutionBarrier
from sidecar.deliveries import Delivery, Held, ModelScheduler
from sidecar.intake import Intake
from sidecar.ipc_client import IpcClient
from sidecar.liveness import ConfigView, Liveness
from sidecar.metrics import SidecarMetrics
from sidecar.readiness import Readiness, WorkerHealth
from sidecar.scheduling import Scheduler, cancel_and_wait
from sidecar.settings import SidecarSettings
from sidecar.settlement import Settlement
from sidecar.tombstones import Tombstones
from sidecar.worker_link import WorkerLink

if TYPE_CHECKING:
    from protocol.work import Heartbeat

log = logging.getLogger("sie.sidecar")

__all__ = ["Delivery", "LaneConsumer", "ModelScheduler", "WorkerHealth"]

STATS = (
    "received",
    "published",
    "acked",
    "naked",
    "dropped",
    "batches",
    "progress",
    "dead_lettered",
    "direct",
)


class LaneConsumer:
    def __init__(
        self,
        nc: NATS,
        ipc_client: IpcClient,
        settings: SidecarSettings,
        *,
        barrier: ExecutionBarrier | None = None,
        worker: WorkerHealth | None = None,
        config: ConfigView | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.ipc = ipc_client
        self.settings = settings
        # Batches hold it shared on the worker; config applies hold it exclusively.
        self.barrier = barrier or ExecutionBarrier()
        self.worker = worker or WorkerHealth()
        self.config = config  # None: no config deltas applied (the worker's own hash is advertised)
        self.link = WorkerLink(ipc_client)
        self.held = Held()
        self.tombstones = Tombstones(settings.cancel_tombstone_ttl_s)
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)  # counters (observability and tests)
        self.metrics = SidecarMetrics(settings.pool, settings.machine_profile, settings.bundle)
        self.stopping = asyncio.Event()
        clock = clock or MonotonicClock()
        # work items and results over the NATS max payload (iokit.payloads)
        self.payloads = PayloadStore(
            self.js,
            storage=settings.stream_storage,
            replicas=settings.stream_replicas,
            max_age_s=settings.stream_max_age_s,
        )
        self.settlement = Settlement(
            nc,
            self.js,
            payloads=self.payloads,
            worker_id=settings.worker_id,
            nak_delay_s=settings.nak_delay_s,
            oom_nak_delay_s=settings.oom_nak_delay_s,
            held=self.held,
            stats=self.stats,
            clock=clock,
        )
        self.readiness = Readiness(self.link, settings, self.worker, self.settlement, self.stopping, clock)
        self.scheduler = Scheduler(
            settings,
            worker=self.link,
            readiness=self.readiness,
            settlement=self.settlement,
            payloads=self.payloads,
            barrier=self.barrier,
            tombstones=self.tombstones,
            metrics=self.metrics,
            stats=self.stats,
            stopping=self.stopping,
            clock=clock,
        )
        self.liveness = Liveness(
            nc,
            settings,
            worker=self.readiness,
            load=self.scheduler,
            config=config,
            held=self.held,
            leases=self.settlement,
            stopping=self.stopping,
            clock=clock,
        )
        self.intake = Intake(
            nc,
            settings,
            queue=self.scheduler,
            worker=self.readiness,
            settlement=self.settlement,
            held=self.held,
            tombstones=self.tombstones,
            metrics=self.metrics,
            stats=self.stats,
            stopping=self.stopping,
            clock=clock,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.watch(self)

    # ------------------------------------------------------------------ what others read
    @property
    def stream(self) -> str:
        return self.intake.stream

    @property
    def durable(self) -> str:
        return self.intake.durable

    @property
    def bulk_durable(self) -> str:
        return self.intake.bulk_durable

    @property
    def schedulers(self) -> dict[str, ModelScheduler]:
        return self.scheduler.schedulers

    @property
    def inflight_batches(self) -> int:
        return self.scheduler.inflight_batches

    @property
    def saturated(self) -> bool:
        return self.scheduler.saturated

    @property
    def ready(self) -> bool:
        return self.readiness.ready

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def heartbeat(self, *, terminated: bool = False) -> Heartbeat:
        return self.liveness.heartbeat(terminated=terminated)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.ipc.on_disconnect = self._worker_lost
        await self.intake.ensure_jetstream()
        await self.intake.start()
        # a gateway that starts or reconnects asks for every heartbeat at once
        await self.nc.subscribe(HEALTH_SOLICIT, cb=self._on_solicit)
        self._tasks = [
            asyncio.create_task(self.intake.pull_loop(INTERACTIVE), name="sidecar-pull"),
            asyncio.create_task(self.intake.pull_loop(BULK), name="sidecar-pull-bulk"),
            asyncio.create_task(self.liveness.progress_loop(), name="sidecar-progress"),
            asyncio.create_task(self.readiness.ping_loop(self.liveness.announce), name="sidecar-ping"),
            asyncio.create_task(self.liveness.heartbeat_loop(), name="sidecar-heartbeat"),
        ]

    async def _on_solicit(self, _msg: Msg) -> None:
        await self.liveness.announce()  # nothing while stopping: the tombstone stays the last word

    def on_reconnect(self) -> None:
        """After a NATS reconnect: open new pull requests now (:meth:`Intake.forget_requests`)."""
        self.intake.forget_requests()

    def _worker_lost(self, reason: str) -> None:
        """The IPC connection closed (the worker died or restarts): not ready at once, stop pulling,
        and give back every queued item now (in-flight batches fail with the connection and NAK
        theirs), instead of holding them until Pings go stale and leases run out."""
        if self.stopping.is_set():
            return
        log.warning(
            "worker connection lost (%s): not ready, returning %d held item(s)", reason, len(self.held)
        )
        self.worker.forget()
        self.scheduler.unready_all()
        self.scheduler.spawn(self._give_back_queued())

    async def _give_back_queued(self) -> None:
        await self.liveness.announce()
        await self.scheduler.give_back_queued(self.readiness.transport_nak_delay)

    async def stop(self, *, drain_timeout_s: float | None = None) -> None:
        """Tombstone heartbeat, stop pulling, Drain the worker, finish in-flight batches, NAK the rest."""
        if self.stopping.is_set():
            return
        budget = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        overflow = self.settings.overflow_nak_delay_s
        self.stopping.set()
        if self.config is not None:
            with contextlib.suppress(Exception):
                await self.config.stop()
        with contextlib.suppress(Exception):
            await self.liveness.publish_heartbeat(terminated=True)
            await self.nc.flush(timeout=2)
        await cancel_and_wait(self._tasks)
        # Queued items go back at once so another pod can take them.
        await self.scheduler.give_back_queued(lambda: overflow)
        with contextlib.suppress(Exception):
            await self.link.drain(budget)
        await self.scheduler.finish(budget)
        for d in list(self.held):
            await self.settlement.nak(d, overflow)
        await self.intake.stop()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)
