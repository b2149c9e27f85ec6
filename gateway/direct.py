"""The direct path (docs/ha.md): a lane's work sent to its sidecars on core NATS while its stream or
durable has no leader.

With replicated streams a lane stops when the member leading its stream or its durable dies:
nothing is stored or delivered until the other members elect a new leader, 4-9 s later (NATS does
not let that be shortened). A request without a result for ``after_s`` makes the gateway ask the
lane's stream and durable for their info (their leaders answer); when either does not answer, the
lane's unanswered items, and its new requests while that lasts, go to its sidecars on core NATS
(``sie.direct.<work subject>``, a queue group per durable) instead. Nothing keeps an item sent that
way: a message no sidecar said it took (``Sie-Taken``) within DIRECT_TAKE_S, or one taken without a
result after DIRECT_RESEND_S, is sent again, directly while the lane has no leader, else to the
stream. An item may so run twice (the stream delivers what it held once it has a leader again); the
first result fills its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from prometheus_client import Counter

from gateway.calls import one_at_a_time
from gateway.metrics import labelled
from gateway.pending import Collector, PendingRequests
from gateway.publisher import AckedPublisher
from gateway.redispatch import Resender
from gateway.routing import Lane
from protocol.streams import DEFAULT_ACK_WAIT_S
from protocol.subjects import INTERACTIVE, direct_subject, lane_durable, pool_stream_name, taken_subject
from protocol.work_codec import WorkMessage

log = logging.getLogger(__name__)

# How often requests are looked at for a stall, how long a lane's leader probe may take, how often a
# lane without a leader is asked again, after how long a message sent directly that no sidecar said
# it took is sent again (it went to a connection that had died, or its sidecars were cut off
# themselves), and after how long an item taken without a result is (as long as a delivery's ack
# wait: the sidecar that took it may have died, core NATS keeps nothing).
DIRECT_TICK_S = 0.25
LANE_PROBE_TIMEOUT_S = 0.5
LANE_PROBE_INTERVAL_S = 0.5
DIRECT_TAKE_S = 0.5
DIRECT_RESEND_S = DEFAULT_ACK_WAIT_S


def has_leader(info: Any) -> bool:
    """Whether a replicated stream's or durable's info names its leader. A member restarted after a
    kill -9 answers for a durable it has not yet rejoined with the durable's config and no cluster
    part; taken for its leader's answer, it sent the lane's work back to the stream for the whole
    election (4-9 s without results)."""
    return info.cluster is not None and bool(info.cluster.leader)


class LaneLeaders(Protocol):
    async def missing(self, lane: Lane) -> str | None:
        """Why ``lane``'s stream or durable has no leader now; None when both have theirs."""
        ...


class JetStreamLeaders:
    """Asks a lane's stream and durable for their info: their leaders answer."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=LANE_PROBE_TIMEOUT_S)

    async def missing(self, lane: Lane) -> str | None:
        """Why the lane has no leader: either does not answer, answers that it has none, or answers
        without naming one (:func:`has_leader`). A stream or durable not found is no election to
        wait out, and neither is this gateway being cut off itself (the reconnect re-dispatches)."""
        stream = pool_stream_name(lane.pool)
        durable = lane_durable(lane.pool, lane.machine_profile, lane.bundle, lane.priority)
        try:
            infos = (await self.js.stream_info(stream), await self.js.consumer_info(stream, durable))
        except nats.js.errors.NotFoundError:
            return None
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            return str(exc) if self.nc.is_connected else None
        return None if all(has_leader(info) for info in infos) else "answered without one"


class DirectPath:
    def __init__(
        self,
        nc: NATS,
        router_id: str,
        pending: PendingRequests,
        publisher: AckedPublisher,
        resender: Resender,
        *,
        sent_items: Counter,
        after_s: float,
        leaders: LaneLeaders,
    ) -> None:
        self.nc = nc
        self.router_id = router_id
        self.pending = pending
        self.publisher = publisher
        self.resender = resender
        self._sent_items = sent_items  # items sent on the direct path, by priority
        self.after_s = after_s  # 0: off (one server has no election to wait out)
        self.leaders = leaders
        # the durables found without a leader (theirs or their stream's) and when last asked
        self._leaderless: dict[str, Lane] = {}
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self._probed: dict[str, float] = {}
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.after_s > 0:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_stalls(), name="direct-path")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(BaseException):
                await self._watcher
            self._watcher = None

    def leaderless(self, durable: str) -> bool:
        """Whether the lane of ``durable`` was last found without a leader."""
        return durable in self._leaderless

    def went_direct(self, request_id: str) -> bool:
        col = self.pending.get(request_id)
        return col is not None and col.direct_at is not None

    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(DIRECT_TICK_S)
            try:
                await self.look_for_stalls(time.monotonic())
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("looking for stalled lanes failed")

    async def look_for_stalls(self, now: float) -> None:
        """One look at the requests in flight at ``now`` (time.monotonic()): what is due goes
        (again) on the direct path or back to the stream, and the lanes of requests stalled for
        ``after_s`` (and those without a leader) are asked for their leaders."""
        if not self.nc.is_connected:
            return
        stalled: dict[str, Lane] = {}
        for col in self.pending.snapshot():
            if col.future.done() or col.lane is None:
                continue
            durable = col.durable
            if col.direct_at is not None:
                overdue = now - max(col.direct_at, col.progress_at) >= DIRECT_RESEND_S
                untaken = bool(col.untaken) and now - col.direct_at >= DIRECT_TAKE_S
                if durable in self._leaderless:
                    if overdue:
                        await self.send(col, col.missing())
                    elif untaken:
                        await self.send(col, col.missing_untaken())
                elif overdue or untaken:
                    # the lane has its leaders again: back to the stream, which keeps them
                    col.direct_at = None
                    col.untaken.clear()
                    col.progress_at = now
                    self.resender.background(self.resender.send_again(col, col.missing()))
            elif durable in self._leaderless:
                await self.send(col, col.missing())
            elif now - col.progress_at >= self.after_s:
                stalled[durable] = col.lane
        for durable, lane in self._leaderless.items():  # asked again until it has its leaders
            stalled.setdefault(durable, lane)
        for durable, lane in stalled.items():
            if durable not in self._probes and now - self._probed.get(durable, 0.0) >= LANE_PROBE_INTERVAL_S:
                self._probed[durable] = now
                one_at_a_time(
                    self._probes, durable, functools.partial(self.check_lane, lane), f"probe-{durable}"
                )

    async def check_lane(self, lane: Lane) -> bool:
        """Ask for the lane's leaders; mark it leaderless when one is missing, and its leaders back
        when both are there. Returns whether the lane is leaderless."""
        durable = lane_durable(lane.pool, lane.machine_profile, lane.bundle, lane.priority)
        why = await self.leaders.missing(lane)
        if why is not None:
            if durable not in self._leaderless:
                log.warning("lane %s has no leader (%s): its work goes on the direct path", durable, why)
            self._leaderless[durable] = lane
        elif self._leaderless.pop(durable, None) is not None:
            log.warning("lane %s has its leaders again: its work goes to the stream", durable)
        return why is not None

    async def send(self, col: Collector, missing: list[WorkMessage]) -> None:
        """Send ``missing`` (messages of ``col``) to the lane's sidecars on core NATS, each asking the
        sidecar that takes it to say so (``Sie-Taken``); a publish of the request still waiting for
        its acks stops waiting."""
        col.direct_at = time.monotonic()
        self.publisher.abandon(col.request_id)
        subject = direct_subject(col.subject)
        col.untaken.update(m.slots[0] for m in missing)
        try:
            for m in missing:
                taken = taken_subject(self.router_id, col.request_id, m.slots[0])
                await self.nc.publish(subject, m.payload, headers=m.direct(taken))
        except Exception as exc:  # noqa: BLE001 - sent again after DIRECT_RESEND_S without a result
            log.warning("sending work on the direct path failed: %s", exc)
        labelled(self._sent_items, col.lane.priority if col.lane else INTERACTIVE).inc(
            sum(len(m.slots) for m in missing)
        )
