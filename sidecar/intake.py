"""Pulling from the lane's durables, validating each delivery and handing it to the scheduler; cancels.

Two pull loops, one per priority class: interactive work from the lane durable, bulk work from the
lane's ``_bulk`` durable. They share the held budget (``max_held_messages``) by weight: bulk may fill
``bulk_max_held_share`` of it, so room is always left for interactive work to be pulled at once, and
interactive work leaves ``bulk_min_held_share`` to bulk, so bulk is never starved of deliveries.

:class:`Intake` sees the scheduler through :class:`Queue` (submit, cancel), the worker's presence
through :class:`WorkerPresence` and settles what it refuses through :class:`IntakeSettler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from protocol import tracing
from protocol.clock import Clock
from protocol.errors import ErrorCode
from protocol.jobs import OPERATIONS
from protocol.subjects import (
    BULK,
    INTERACTIVE,
    WORK_CANCEL_PREFIX,
    direct_subject,
    in_lane,
    is_valid_reply_subject,
    lane_filter,
    lane_prefix,
    subject_priority,
    work_subject_of_direct,
)
from protocol.work import WorkResult
from protocol.work_codec import H_TAKEN, WorkCodec
from sidecar.deliveries import Delivery, Held, Lease
from sidecar.metrics import SidecarMetrics
from sidecar.puller import Puller
from sidecar.settings import SidecarSettings
from sidecar.streams import ensure_lane_consumer, ensure_stream
from sidecar.tombstones import Tombstones, request_id_from_cancel_subject

log = logging.getLogger("sie.sidecar")


class Queue(Protocol):
    """:class:`sidecar.scheduling.Scheduler`, as intake uses it."""

    def submit(self, deliveries: list[Delivery]) -> bool: ...

    async def cancel(self, request_id: str) -> None: ...


class WorkerPresence(Protocol):
    """:class:`sidecar.readiness.Readiness`, as intake uses it."""

    def fresh(self) -> bool: ...

    def transport_nak_delay(self) -> float: ...


class IntakeSettler(Protocol):
    """:class:`sidecar.settlement.Settlement`, as intake uses it."""

    def error_result(self, d: Delivery, code: str, message: str) -> WorkResult: ...

    async def publish_and_ack(
        self, d: Delivery, result: WorkResult | bytes, *, success: bool = False
    ) -> None: ...

    async def nak(self, d: Delivery, delay_s: float) -> None: ...

    async def ack_msg(self, msg: Msg, *, drop: bool = False) -> None: ...

    async def nak_msg(self, msg: Msg, delay_s: float) -> None: ...

    async def dead_letter(self, msg: Msg, reason: str) -> None: ...


class Intake:
    def __init__(
        self,
        nc: NATS,
        settings: SidecarSettings,
        *,
        queue: Queue,
        worker: WorkerPresence,
        settlement: IntakeSettler,
        held: Held,
        tombstones: Tombstones,
        metrics: SidecarMetrics,
        stats: dict[str, int],
        stopping: asyncio.Event,
        clock: Clock,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.queue = queue
        self.worker = worker
        self.settlement = settlement
        self.held = held
        self.tombstones = tombstones
        self.metrics = metrics
        self.stats = stats
        self.stopping = stopping
        self.clock = clock
        self.stream = ""
        self.durable = ""
        self.bulk_durable = ""
        self._lane_prefix = lane_prefix(settings.pool, settings.machine_profile, settings.bundle)
        # per priority class: set when its pull request ends, or, while its loop waits for room, when
        # a delivery is settled (Held.watch)
        self._wakes: dict[str, asyncio.Event] = {INTERACTIVE: asyncio.Event(), BULK: asyncio.Event()}
        self._pullers: dict[str, Puller] = {}
        self._cancel_sub: Subscription | None = None
        self._direct_subs: list[Subscription] = []
        self._reensure: asyncio.Task[None] | None = None
        # per priority class, a running average over its last ten or so messages: interactive
        # messages carry a request of a few items, bulk ones a Batch API line's chunk, and one
        # average of both (single texts arriving 8 times as often as 25-text lines: about 3) had a
        # bulk pull ask for about 7 times its room, fill the held budget past its end and close the
        # interactive pull until bulk batches were settled (interactive items 30-130 ms late)
        self._items_per_message = {INTERACTIVE: 1.0, BULK: 1.0}

    # ------------------------------------------------------------------ start and stop
    async def ensure_jetstream(self) -> None:
        self.stream = await ensure_stream(self.js, self.settings)
        self.durable = await ensure_lane_consumer(self.js, self.stream, self.settings)
        self.bulk_durable = await ensure_lane_consumer(self.js, self.stream, self.settings, BULK)

    async def start(self) -> None:
        """Subscribe to cancellations and to the lane's direct path, and open the two pullers (their
        loops are :meth:`pull_loop`)."""
        self._cancel_sub = await self.nc.subscribe(f"{WORK_CANCEL_PREFIX}.>", cb=self.on_cancel)
        s = self.settings
        for priority, durable in ((INTERACTIVE, self.durable), (BULK, self.bulk_durable)):
            # one queue group per durable: a work message the gateway sends this way (while the lane's
            # stream or durable has no leader) reaches one pod of the lane, like a delivery
            self._direct_subs.append(
                await self.nc.subscribe(
                    direct_subject(lane_filter(s.pool, s.machine_profile, s.bundle, priority)),
                    queue=durable,
                    cb=self.delivered_direct,
                )
            )
            puller = Puller(
                self.nc,
                self.stream,
                durable,
                self.delivered,
                expires_s=self.settings.nats_fetch_timeout_s,
                wake=self._wakes[priority],
            )
            await puller.start()
            self._pullers[priority] = puller

    def forget_requests(self) -> None:
        """After a NATS reconnect the open pull requests may have died with the old connection (a
        restarted server has none): open new ones now rather than at their expiry."""
        for puller in self._pullers.values():
            puller.forget()

    async def stop(self) -> None:
        """Close the pullers and the cancel and direct subscriptions (the pull loops are stopped
        already)."""
        for sub in self._direct_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._direct_subs.clear()
        for puller in self._pullers.values():
            with contextlib.suppress(Exception):
                await puller.stop()
        if self._cancel_sub is not None:
            with contextlib.suppress(Exception):
                await self._cancel_sub.unsubscribe()

    async def _ensure_again(self) -> None:
        try:
            await self.ensure_jetstream()
            self.stats["reensured"] = self.stats.get("reensured", 0) + 1
        except Exception as exc:  # noqa: BLE001
            log.warning("re-ensuring stream/consumer failed: %s", exc)
        finally:
            self._reensure = None

    # ------------------------------------------------------------------ pulling
    def free(self, priority: str) -> int:
        """How many more deliveries of ``priority`` may be pulled now."""
        s = self.settings
        limit = max(1, s.max_held_messages)
        bulk_held = self.held.count(BULK)
        if priority == BULK:
            return min(max(1, int(limit * s.bulk_max_held_share)) - bulk_held, limit - len(self.held))
        kept_for_bulk = max(0, int(limit * s.bulk_min_held_share) - bulk_held)
        return limit - len(self.held) - kept_for_bulk

    def messages_for(self, items: int, priority: str = INTERACTIVE) -> int:
        """Messages of ``priority`` to ask for to receive about ``items`` items: a message carries
        one item or a chunk of a request's (the class's recent average decides), so that a pull of
        chunks does not bring many times the room and have the model queues turn the excess away."""
        return max(1, int(items / self._items_per_message[priority]))

    async def pull_loop(self, priority: str = INTERACTIVE) -> None:
        """Keep one pull request open on the lane durable of ``priority`` while there is room:
        deliveries are handed to :meth:`intake` as they arrive (:mod:`sidecar.puller`)."""
        puller = self._pullers[priority]
        wake = self._wakes[priority]
        reported = 0
        while not self.stopping.is_set():
            if not self.worker.fresh():
                # No worker to run anything: leave the work in the stream for the lane's other pods
                # instead of pulling it only to NAK it and burn its deliveries.
                await asyncio.sleep(self.settings.worker_ping_interval_ms / 1000.0 / 2)
                continue
            if puller.failures > reported:
                reported = puller.failures
                log.warning("pull request failed: %s", puller.last_failure)
                # short and capped: on a JetStream cluster a durable without a leader (its leader died,
                # an election takes some seconds) answers 503 until one is elected, and the pulls
                # should resume the moment it is
                await asyncio.sleep(min(1.0, 0.1 * puller.failures))
                if puller.failures % 5 == 0 and self._reensure is None:
                    # the stream or durable may be gone (memory storage after a NATS restart): ensure
                    # them beside the pulls, which go on (an ensure waits out an election too)
                    self._reensure = asyncio.create_task(self._ensure_again(), name="sidecar-reensure")
            elif puller.failures == 0:
                reported = 0
            wake.clear()  # before looking: a change from here on wakes the wait below
            free = self.free(priority)
            if not puller.is_open and free > 0:
                try:
                    await puller.request(
                        min(self.settings.nats_fetch_budget, self.messages_for(free, priority))
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - keep the one pull loop alive across NATS trouble
                    log.warning("pull request not sent (%s): %s", type(exc).__name__, exc)
                    await asyncio.sleep(0.2)
                continue
            # a request is open (deliveries come to intake by themselves; wait for it to end or be
            # overdue), or there is no room (wait for a settlement to make some)
            if not puller.is_open:
                self.held.watch(priority, wake)
            try:
                async with asyncio.timeout(puller.seconds_left()):
                    await wake.wait()
            except TimeoutError:
                pass
            finally:
                self.held.unwatch(priority)

    async def delivered(self, msg: Msg) -> None:
        """A delivery from a pull request: intake, or straight back to the stream once stopping."""
        if self.stopping.is_set():
            await self.settlement.nak_msg(msg, self.settings.overflow_nak_delay_s)
            return
        try:
            await self.intake(msg)
        except Exception:  # noqa: BLE001 - one bad message never stops the deliveries
            log.exception("intake failed")

    async def delivered_direct(self, msg: Msg) -> None:
        """A work message the gateway sent on the direct path: taken like a delivery from the lane's
        stream, under its work subject, once the gateway has been told it was taken (``Sie-Taken``:
        what no sidecar takes is sent again within a second). It has no reply subject, so there is
        nothing to ACK, NAK or progress-ACK (:mod:`sidecar.settlement`): an item refused or lost here
        is sent again by the gateway, which waits for its result."""
        work = work_subject_of_direct(msg.subject)
        if work is None or msg.reply:
            log.warning("dropping a direct work message on %s with reply %r", msg.subject, msg.reply)
            return
        if self.stopping.is_set():
            return  # not taken: the gateway sends it again to a pod that is not stopping
        taken = (msg.headers or {}).get(H_TAKEN)
        if taken is not None and is_valid_reply_subject(taken):
            with contextlib.suppress(Exception):  # not heard: the gateway sends it again, run twice
                await self.nc.publish(taken, b"")
        self.stats["direct"] += 1
        msg.subject = work
        await self.delivered(msg)

    async def intake(self, msg: Msg) -> None:
        """Validate one delivery and queue its items on their model's scheduler (or settle it right
        away). A message carries one item or a chunk of one request's (protocol.work_codec)."""
        self.stats["received"] += 1
        now = self.clock.now()
        if not in_lane(msg.subject, self._lane_prefix):
            log.warning("NAK message on unexpected subject %s", msg.subject)
            await self.settlement.nak_msg(msg, self.settings.nak_delay_s)
            return
        try:
            routes = WorkCodec.routes(msg.headers)
        except ValueError as exc:
            log.warning("dead-lettering undecodable work item on %s: %s", msg.subject, exc)
            await self.settlement.dead_letter(msg, f"undecodable work item: {exc}")
            return
        if WorkCodec.payload_ref(msg.headers) is not None:  # in the payload store, read when its batch runs
            shared, bodies = b"", [b""] * len(routes)
        else:
            try:
                shared, bodies = WorkCodec.split(msg.data, len(routes))
            except ValueError:
                # the worker finds it is no job and answers each item under its route: the request is
                # answered now, not at its deadline, and the message dead-lettered
                shared, bodies = msg.data, [b""] * len(routes)
        route = routes[0]  # what the items of a message share: request, inboxes, model, operation
        if not is_valid_reply_subject(route.reply_subject) or (
            route.results_subject is not None and not is_valid_reply_subject(route.results_subject)
        ):
            log.warning(
                "dropping work item %s: reply subject %r or results subject %r is not an inbox",
                route.work_item_id,
                route.reply_subject,
                route.results_subject,
            )
            await self.settlement.ack_msg(msg, drop=True)
            return
        if route.request_id in self.tombstones:
            await self.settlement.ack_msg(msg, drop=True)
            return
        if not self.worker.fresh():
            # fetched just as the worker went away: give it back for other pods
            await self.settlement.nak_msg(msg, self.worker.transport_nak_delay())
            return
        priority = subject_priority(msg.subject)
        self._items_per_message[priority] += 0.1 * (len(routes) - self._items_per_message[priority])
        lease = Lease(msg, open=len(routes), last_progress=now)
        received_wall = time.time()
        delivered = lease.num_delivered
        deliveries = [
            Delivery(
                lease=lease,
                body=body,
                shared=shared,
                route=r,
                spec=r.model_spec,
                cost=1,
                arrived=now,
                received_wall=received_wall,
                estimate=r.cost,
                priority=priority,
                # its request's items to batch together (1 for a redelivery: its siblings are done)
                request_items=route.request_items if delivered == 1 else 1,
            )
            for r, body in zip(routes, bodies, strict=True)
        ]
        for d in deliveries:
            self.held.add(d)
        if route.timestamp is not None:
            self.metrics.queue_wait.observe(max(0.0, received_wall - route.timestamp))
        if delivered > 1:
            self.metrics.redeliveries.inc()
        if tracing.enabled() and route.timestamp is not None:  # one span per message: one request's
            tracing.record(
                "sidecar.queue_wait",
                parent=route.traceparent,
                start_s=route.timestamp,
                end_s=received_wall,
                attributes={"delivery": delivered, "items": len(routes)},
            )
        if route.operation not in OPERATIONS:
            for d in deliveries:
                await self.settlement.publish_and_ack(
                    d,
                    self.settlement.error_result(
                        d, ErrorCode.INVALID_INPUT, f"unknown operation {route.operation!r}"
                    ),
                )
            return
        if not self.queue.submit(deliveries):  # over the model's held budget
            for d in deliveries:
                await self.settlement.nak(d, self.settings.overflow_nak_delay_s)

    # ------------------------------------------------------------------ cancellation
    async def on_cancel(self, msg: Msg) -> None:
        request_id = request_id_from_cancel_subject(msg.subject)
        if not request_id:
            return
        self.tombstones.add(request_id)
        await self.queue.cancel(request_id)
