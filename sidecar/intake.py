"""Pulling from the lane durables, validating each delivery and queueing it; cancellations.

Two pull loops, one per priority class: interactive work from the lane durable, bulk work from the
lane's ``_bulk`` durable. They share the held budget (``max_held_messages``) by weight: bulk may fill
``bulk_max_held_share`` of it, so room is always left for interactive work to be pulled at once, and
interactive work leaves ``bulk_min_held_share`` to bulk, so bulk is never starved of deliveries.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from protocol import tracing
from protocol.errors import ErrorCode
from protocol.subjects import BULK, INTERACTIVE, in_lane, is_valid_reply_subject, subject_priority
from protocol.work import OPERATIONS, RoutingHeader
from sidecar.deliveries import Delivery
from sidecar.puller import Puller
from sidecar.scheduling import Scheduling
from sidecar.streams import ensure_lane_consumer, ensure_stream
from sidecar.tombstones import request_id_from_cancel_subject

log = logging.getLogger("sie.sidecar")


class Intake(Scheduling):
    async def ensure_jetstream(self) -> None:
        self.stream = await ensure_stream(self.js, self.settings)
        self.durable = await ensure_lane_consumer(self.js, self.stream, self.settings)
        self.bulk_durable = await ensure_lane_consumer(self.js, self.stream, self.settings, BULK)

    async def start_pullers(self) -> None:
        for priority, durable in ((INTERACTIVE, self.durable), (BULK, self.bulk_durable)):
            puller = Puller(
                self.nc,
                self.stream,
                durable,
                self._delivered,
                expires_s=self.settings.nats_fetch_timeout_s,
                wake=self._wakes[priority],
            )
            await puller.start()
            self._pullers[priority] = puller

    # ------------------------------------------------------------------ pulling
    def _free(self, priority: str) -> int:
        """How many more deliveries of ``priority`` may be pulled now."""
        s = self.settings
        limit = max(1, s.max_held_messages)
        bulk_held = sum(1 for d in self.held if d.priority == BULK)
        if priority == BULK:
            return min(max(1, int(limit * s.bulk_max_held_share)) - bulk_held, limit - len(self.held))
        kept_for_bulk = max(0, int(limit * s.bulk_min_held_share) - bulk_held)
        return limit - len(self.held) - kept_for_bulk

    async def _pull_loop(self, priority: str = INTERACTIVE) -> None:
        """Keep one pull request open on the lane durable of ``priority`` while there is room:
        deliveries are handed to :meth:`intake` as they arrive (:mod:`sidecar.puller`)."""
        puller = self._pullers[priority]
        wake = self._wakes[priority]
        reported = 0
        while not self._stop.is_set():
            if not self.worker.fresh(self._worker_stale_after_s()):
                # No worker to run anything: leave the work in the stream for the lane's other pods
                # instead of pulling it only to NAK it and burn its deliveries.
                await asyncio.sleep(self.settings.worker_ping_interval_ms / 1000.0 / 2)
                continue
            if puller.failures > reported:
                reported = puller.failures
                log.warning("pull request failed: %s", puller.last_failure)
                await asyncio.sleep(min(5.0, 0.2 * puller.failures))
                if puller.failures % 5 == 0:
                    # the stream or durable may be gone (memory storage after a NATS restart)
                    try:
                        await self.ensure_jetstream()
                        self.stats["reensured"] = self.stats.get("reensured", 0) + 1
                    except Exception as ens:  # noqa: BLE001
                        log.warning("re-ensuring stream/consumer failed: %s", ens)
            elif puller.failures == 0:
                reported = 0
            wake.clear()  # before looking: a change from here on wakes the wait below
            free = self._free(priority)
            if not puller.is_open and free > 0:
                try:
                    await puller.request(min(self.settings.nats_fetch_budget, free))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - keep the one pull loop alive across NATS trouble
                    log.warning("pull request not sent (%s): %s", type(exc).__name__, exc)
                    await asyncio.sleep(0.2)
                continue
            # a request is open (deliveries come to intake by themselves; wait for it to end or be
            # overdue), or there is no room (wait for a settlement to make some)
            if not puller.is_open:
                self._room_wanted.add(priority)
            try:
                async with asyncio.timeout(puller.seconds_left()):
                    await wake.wait()
            except TimeoutError:
                pass
            finally:
                self._room_wanted.discard(priority)

    async def _delivered(self, msg: Msg) -> None:
        """A delivery from a pull request: intake, or straight back to the stream once stopping."""
        if self._stop.is_set():
            await self._raw_nak(msg, self.settings.overflow_nak_delay_s)
            return
        try:
            await self.intake(msg)
        except Exception:  # noqa: BLE001 - one bad message never stops the deliveries
            log.exception("intake failed")

    async def intake(self, msg: Msg) -> None:
        """Validate one delivery and queue it on its model's scheduler (or settle it right away)."""
        self.stats["received"] += 1
        now = time.monotonic()
        if not in_lane(msg.subject, self._lane_prefix):
            log.warning("NAK message on unexpected subject %s", msg.subject)
            await self._raw_nak(msg, self.settings.nak_delay_s)
            return
        try:
            route = RoutingHeader.from_headers(msg.headers)
        except ValueError as exc:
            log.warning("dead-lettering undecodable work item on %s: %s", msg.subject, exc)
            await self._dead_letter(msg, f"undecodable work item: {exc}")
            return
        if not is_valid_reply_subject(route.reply_subject) or (
            route.results_subject is not None and not is_valid_reply_subject(route.results_subject)
        ):
            log.warning(
                "dropping work item %s: reply subject %r or results subject %r is not an inbox",
                route.work_item_id,
                route.reply_subject,
                route.results_subject,
            )
            await self._raw_ack(msg, drop=True)
            return
        if route.request_id in self.tombstones:
            await self._raw_ack(msg, drop=True)
            return
        if not self.worker.fresh(self._worker_stale_after_s()):
            # fetched just as the worker went away: give it back for other pods
            await self._raw_nak(msg, self._transport_nak_delay())
            return
        d = Delivery(
            msg=msg,
            route=route,
            spec=route.model_spec,
            cost=1,
            arrived=now,
            received_wall=time.time(),
            last_progress=now,
            priority=subject_priority(msg.subject),
        )
        self.held.add(d)
        if route.timestamp is not None:
            self.metrics.queue_wait.observe(max(0.0, d.received_wall - route.timestamp))
        delivered = d.num_delivered
        if delivered > 1:
            self.metrics.redeliveries.inc()
        else:
            d.request_items = route.request_items
        if tracing.enabled() and route.timestamp is not None:
            tracing.record(
                "sidecar.queue_wait",
                parent=route.traceparent,
                start_s=route.timestamp,
                end_s=d.received_wall,
                attributes={"delivery": delivered},
            )
        if route.operation not in OPERATIONS:
            await self._publish_and_ack(
                d, self._error_result(d, ErrorCode.INVALID_INPUT, f"unknown operation {route.operation!r}")
            )
            return
        sched = self._scheduler(d.spec)
        d.estimate = route.cost
        d.cost = sched.cost_of(d.estimate)
        cap = max(1, sched.limits.max_requests) * self.settings.max_concurrent_batches * 2
        # per class: a bulk backlog never turns interactive work away
        if sched.pending_count(d.priority) >= cap and d.num_delivered < max(
            2, self.settings.max_deliver // 2
        ):
            await self._nak(d, self.settings.overflow_nak_delay_s)
            return
        if d.priority != BULK:
            sched.last_interactive = now
        sched.batcher(route.operation, d.group, d.priority).add(d)
        sched.wake.set()

    # ------------------------------------------------------------------ cancellation
    async def _on_cancel(self, msg: Msg) -> None:
        request_id = request_id_from_cancel_subject(msg.subject)
        if not request_id:
            return
        self.tombstones.add(request_id)
        for sched in self.schedulers.values():
            for b in sched.batchers.values():
                for d in b.remove(lambda e: e.route.request_id == request_id):
                    await self._ack(d, drop=True)
