"""Publishing work items to JetStream and collecting their results from one NATS core inbox.

One :class:`Dispatcher` per gateway process: it owns the ``router_id`` (the inbox namespace), the
single ``_INBOX.{router_id}.>`` subscription, the table of pending requests and the stream caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import StreamConfig

from gateway.metrics import GatewayMetrics, labelled
from gateway.publisher import AckedPublisher, PublishAbandoned
from gateway.routing import Lane
from iokit.payloads import PayloadStore
from protocol import tracing
from protocol.errors import ErrorCode, SIEError
from protocol.streams import DEFAULT_ACK_WAIT_S, reconcile_stream, stream_config, stream_fields
from protocol.subjects import (
    BULK,
    INTERACTIVE,
    TAKEN_TOKEN,
    direct_subject,
    inbox_prefix,
    lane_durable,
    pool_stream_name,
    reply_subject,
    results_subject,
    taken_subject,
    work_cancel_subject,
    work_subject,
)
from protocol.work import (
    H_TAKEN,
    MSG_ID,
    ItemRef,
    WorkResult,
    redispatch_msg_id,
    unpack_results,
    work_item_id,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

STREAM_INFO_TTL_S = 0.25
# Past its TTL the cached count still answers, while one call refreshes it beside the requests
# (waiting for that call put its latency, 80-200 ms with a batch loading NATS, on every fourth of a
# second's first request; while the stream elects a new leader, 4-9 s, the call fails, and the
# request with it, where the publish would have waited out the election). A stale count plus what
# was admitted since only overestimates the queue. Past this age requests wait for the call again.
STREAM_INFO_MAX_STALE_S = 15.0
STREAM_PROBE_TIMEOUT_S = 1.0
# The direct path (docs/ha.md): how often requests are looked at for a stall, how long a lane's
# leader probe may take, how often a lane without a leader is asked again, after how long a message
# sent directly that no sidecar said it took is sent again (it went to a connection that had died, or
# its sidecars were cut off themselves), and after how long an item taken without a result is (as
# long as a delivery's ack wait: the sidecar that took it may have died, core NATS keeps nothing).
DIRECT_TICK_S = 0.25
LANE_PROBE_TIMEOUT_S = 0.5
LANE_PROBE_INTERVAL_S = 0.5
DIRECT_TAKE_S = 0.5
DIRECT_RESEND_S = DEFAULT_ACK_WAIT_S


@dataclass
class WorkMessage:
    """One work message of a request: the slots of the items it carries (one, or a chunk's), its
    body and headers (protocol.work), and the payload-store object its one item went to, if any."""

    slots: tuple[int, ...]
    payload: bytes
    headers: dict[str, str]
    offloaded: str | None = None


@dataclass
class Collector:
    total: int
    results: list[WorkResult | None]
    future: asyncio.Future[list[WorkResult]]
    remaining: int = field(init=False)
    # what was published, kept (by reference: the caller holds it anyway) until the request ends, so
    # that items whose results were lost while this gateway was cut off can be sent again
    subject: str = ""
    sent: list[WorkMessage] = field(default_factory=list)
    published: bool = False  # every item acknowledged by the stream
    redispatches: int = 0
    request_id: str = ""
    lane: Lane | None = None
    progress_at: float = 0.0  # time.monotonic() of its start, then of its latest result
    direct_at: float | None = None  # when its unanswered items were last sent on the direct path
    # the messages (by first slot) sent on the direct path that no sidecar has said it took
    untaken: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.remaining = sum(1 for r in self.results if r is None)

    @property
    def durable(self) -> str:
        lane = self.lane
        return lane_durable(lane.pool, lane.machine_profile, lane.bundle, lane.priority) if lane else ""

    def missing(self) -> list[WorkMessage]:
        """Its messages that carry an item without a result."""
        return [m for m in self.sent if any(self.results[slot] is None for slot in m.slots)]

    def missing_untaken(self) -> list[WorkMessage]:
        """Its messages sent on the direct path that no sidecar took, and still without a result."""
        return [m for m in self.missing() if m.slots[0] in self.untaken]

    def put(self, result: WorkResult) -> None:
        idx = result.item_index
        if not isinstance(idx, int) or not 0 <= idx < self.total:
            return
        if self.results[idx] is None:
            self.remaining -= 1
            self.progress_at = time.monotonic()
        self.results[idx] = result  # a duplicate delivery overwrites its slot
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(cast(list[WorkResult], self.results))  # every slot is filled


def has_leader(info: Any) -> bool:
    """Whether a replicated stream's or durable's info names its leader. A member restarted after a
    kill -9 answers for a durable it has not yet rejoined with the durable's config and no cluster
    part; taken for its leader's answer, it sent the lane's work back to the stream for the whole
    election (4-9 s without results)."""
    return info.cluster is not None and bool(info.cluster.leader)


class Dispatcher:
    def __init__(
        self,
        nc: NATS,
        *,
        metrics: GatewayMetrics,
        storage: str = "file",
        max_age_s: float = 1800.0,
        max_msgs: int = 100_000,
        replicas: int = 1,
        max_stream_pending: int = 50_000,
        publish_concurrency: int = 64,
        publish_timeout_s: float = 6.0,
        direct_after_s: float = 1.0,
        queue_full_retry_after_s: float = 1.0,
        bulk_share: float = 1.0,
        router_id: str | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.metrics = metrics
        self.router_id = router_id or str(uuid.uuid4())
        # where sidecars send several of this gateway's results in one message
        self.results_subject = results_subject(self.router_id)
        self._taken_prefix = f"{inbox_prefix(self.router_id)}.{TAKEN_TOKEN}."  # then request and slot
        self.storage = storage
        self.max_age_s = max_age_s
        self.max_msgs = max_msgs
        self.replicas = replicas
        self.max_stream_pending = max_stream_pending
        self.publish_timeout_s = publish_timeout_s
        self.queue_full_retry_after_s = queue_full_retry_after_s
        self.bulk_share = bulk_share
        # work items and results over the NATS max payload (iokit.payloads)
        self.payloads = PayloadStore(self.js, storage=storage, replicas=replicas, max_age_s=max_age_s)
        self.publish_window = publish_concurrency  # a request's items waiting for their acks at once
        self._collectors: dict[str, Collector] = {}
        self._ensured: set[str] = set()
        self._ensure_locks: dict[str, asyncio.Lock] = {}
        self._pending_cache: dict[str, tuple[float, int]] = {}
        # items admitted since the cached stream count was read: a burst inside one cache period
        # cannot overshoot max_stream_pending
        self._admitted_since: dict[str, int] = {}
        # the stream-info call under way per pool: requests that find the count stale start no other
        # (and wait for it only when the count is too old to answer; stream_pending)
        self._refreshing: dict[str, asyncio.Task[int]] = {}
        # whether a stream that took no publish is gone (_stream_gone): one call per pool at a time,
        # with a timeout shorter than a request's
        self._probing: dict[str, asyncio.Task[bool]] = {}
        self._probe_js = nc.jetstream(timeout=STREAM_PROBE_TIMEOUT_S)
        self._sub: Subscription | None = None
        self.publisher = AckedPublisher(nc)
        self._resends: set[asyncio.Task[None]] = set()
        # The direct path, with replicated streams only (one server has no election to wait out):
        # the durables found without a leader (theirs or their stream's) and when last asked
        self.direct_after_s = direct_after_s if replicas > 1 else 0.0
        self._leaderless: dict[str, Lane] = {}
        self._lane_probes: dict[str, asyncio.Task[bool]] = {}
        self._lane_probed: dict[str, float] = {}
        self._lane_probe_js = nc.jetstream(timeout=LANE_PROBE_TIMEOUT_S)
        self._watcher: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._sub = await self.nc.subscribe(inbox_prefix(self.router_id) + ".>", cb=self._on_result)
        await self.publisher.start()
        if self.direct_after_s > 0:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_stalls(), name="direct-path")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(BaseException):
                await self._watcher
            self._watcher = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for col in self._collectors.values():
            if not col.future.done():
                col.future.cancel()
        await self.publisher.stop()

    def on_reconnect(self) -> None:
        """After a NATS reconnect publishes still waiting for their ack (the publish or its ack may
        have died with the old connection) are sent again at once rather than after their timeout.
        A single server may have come back without its streams (memory storage): they are ensured
        again and counted anew. Streams replicated over several members outlive a member; their
        count stays (a request waiting for a stream's info would wait out its election)."""
        if self.replicas == 1:
            self._ensured.clear()
            self._pending_cache.clear()
        self._background(self.publisher.resend())
        self._background(self.redispatch())

    async def redispatch(self) -> int:
        """After a reconnect: publish again each stored message of a request in flight that carries
        an item whose result has not come, under a new ``Nats-Msg-Id``; returns how many items those
        messages carry. A result the sidecar published while this gateway was cut off (its member
        stopped or partitioned away, unnoticed until its pings went unanswered) went to a connection
        that no longer reads: core NATS keeps nothing. An item still being worked on runs twice; the
        first result fills its slot."""
        sends = []
        count = 0
        for col in list(self._collectors.values()):
            if not (col.published or col.direct_at is not None) or col.future.done():
                continue
            missing = col.missing()
            if not missing:
                continue
            count += sum(len(m.slots) for m in missing)
            if col.direct_at is not None and col.durable in self._leaderless:
                await self._send_direct(col, missing)
                continue
            sends.append(self._send_again(col, missing))
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.warning("re-dispatching unanswered items after a reconnect failed: %s", outcome)
        if count:
            log.info(
                "re-dispatched %d unanswered item(s) of %d request(s) after a reconnect", count, len(sends)
            )
        return count

    def _send_again(self, col: Collector, missing: list[WorkMessage]) -> Awaitable[None]:
        """Publish ``missing`` (messages of ``col``) to the stream again under new message ids."""
        col.redispatches += 1
        headers = [
            {**m.headers, MSG_ID: redispatch_msg_id(m.headers.get(MSG_ID, ""), col.redispatches)}
            for m in missing
        ]
        return self.publisher.publish_all(
            col.subject,
            [m.payload for m in missing],
            headers,
            window=self.publish_window,
            timeout_s=self.publish_timeout_s,
        )

    # ---- the direct path -------------------------------------------------------------------
    # With replicated streams a lane stops when the member leading its stream or its durable dies:
    # nothing is stored or delivered until the other members elect a new leader, 4-9 s later (NATS
    # does not let that be shortened). A request without a result for ``direct_after_s`` makes the
    # gateway ask the lane's stream and durable for their info (their leaders answer); when either
    # does not answer, the lane's unanswered items, and its new requests while that lasts, go to its
    # sidecars on core NATS (``sie.direct.<work subject>``, a queue group per durable) instead.
    # Nothing keeps an item sent that way: a message no sidecar said it took (``Sie-Taken``) within
    # DIRECT_TAKE_S, or one taken without a result after DIRECT_RESEND_S, is sent again, directly
    # while the lane has no leader, else to the stream. An item may so run twice (the
    # stream delivers what it held once it has a leader again); the first result fills its slot.
    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(DIRECT_TICK_S)
            try:
                await self._look_for_stalls(time.monotonic())
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("looking for stalled lanes failed")

    async def _look_for_stalls(self, now: float) -> None:
        if not self.nc.is_connected:
            return
        stalled: dict[str, Lane] = {}
        for col in list(self._collectors.values()):
            if col.future.done() or col.lane is None:
                continue
            durable = col.durable
            if col.direct_at is not None:
                overdue = now - max(col.direct_at, col.progress_at) >= DIRECT_RESEND_S
                untaken = bool(col.untaken) and now - col.direct_at >= DIRECT_TAKE_S
                if durable in self._leaderless:
                    if overdue:
                        await self._send_direct(col, col.missing())
                    elif untaken:
                        await self._send_direct(col, col.missing_untaken())
                elif overdue or untaken:
                    # the lane has its leaders again: back to the stream, which keeps them
                    col.direct_at = None
                    col.untaken.clear()
                    col.progress_at = now
                    self._background(self._send_again(col, col.missing()))
            elif durable in self._leaderless:
                await self._send_direct(col, col.missing())
            elif now - col.progress_at >= self.direct_after_s:
                stalled[durable] = col.lane
        for durable, lane in self._leaderless.items():  # asked again until it has its leaders
            stalled.setdefault(durable, lane)
        for durable, lane in stalled.items():
            if (
                durable not in self._lane_probes
                and now - self._lane_probed.get(durable, 0.0) >= LANE_PROBE_INTERVAL_S
            ):
                self._lane_probed[durable] = now
                _one_at_a_time(
                    self._lane_probes, durable, functools.partial(self._probe_lane, lane), f"probe-{durable}"
                )

    async def _probe_lane(self, lane: Lane) -> bool:
        """Ask the lane's stream and durable for their info; mark the lane leaderless when either does
        not answer, answers that it has no leader, or answers without naming one (:func:`has_leader`),
        and its leaders back when both name theirs. A stream or durable not found is no election to
        wait out. Returns whether the lane is leaderless."""
        stream = pool_stream_name(lane.pool)
        durable = lane_durable(lane.pool, lane.machine_profile, lane.bundle, lane.priority)
        why = "answered without one"
        try:
            infos = (
                await self._lane_probe_js.stream_info(stream),
                await self._lane_probe_js.consumer_info(stream, durable),
            )
            leaderless = not all(has_leader(info) for info in infos)
        except nats.js.errors.NotFoundError:
            leaderless = False
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            leaderless = self.nc.is_connected  # cut off ourselves: the reconnect re-dispatches
            why = str(exc)
        if leaderless:
            if durable not in self._leaderless:
                log.warning("lane %s has no leader (%s): its work goes on the direct path", durable, why)
            self._leaderless[durable] = lane
        elif self._leaderless.pop(durable, None) is not None:
            log.warning("lane %s has its leaders again: its work goes to the stream", durable)
        return leaderless

    def _went_direct(self, request_id: str) -> bool:
        col = self._collectors.get(request_id)
        return col is not None and col.direct_at is not None

    async def _send_direct(self, col: Collector, missing: list[WorkMessage]) -> None:
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
                await self.nc.publish(subject, m.payload, headers={**m.headers, H_TAKEN: taken})
        except Exception as exc:  # noqa: BLE001 - sent again after DIRECT_RESEND_S without a result
            log.warning("sending work on the direct path failed: %s", exc)
        labelled(self.metrics.direct_items, col.lane.priority if col.lane else INTERACTIVE).inc(
            sum(len(m.slots) for m in missing)
        )

    def _background(self, work: Awaitable[Any]) -> None:
        """Send items again beside the requests, kept until done; a failure is logged (each
        request's own deadline answers for its items)."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:  # noqa: BLE001 - the request's deadline answers for it
                log.warning("sending unanswered items again failed: %s", exc)

        task = asyncio.get_running_loop().create_task(run(), name="send-again")
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    @property
    def pending_requests(self) -> int:
        return len(self._collectors)

    # ---- streams ---------------------------------------------------------------------------
    def stream_kwargs(self, pool: str) -> dict[str, Any]:
        return stream_config(
            pool,
            storage=self.storage,
            max_age_s=self.max_age_s,
            max_msgs=self.max_msgs,
            replicas=self.replicas,
        )

    async def ensure_stream(self, pool: str) -> None:
        if pool in self._ensured:
            return
        lock = self._ensure_locks.setdefault(pool, asyncio.Lock())
        async with lock:
            if pool in self._ensured:
                return
            desired = self.stream_kwargs(pool)
            name = desired["name"]
            try:
                info = await self.js.stream_info(name)
            except nats.js.errors.NotFoundError:
                try:
                    await self.js.add_stream(StreamConfig(**desired))
                except nats.js.errors.BadRequestError:
                    await self.js.stream_info(name)  # created concurrently by someone else
            else:
                plan = reconcile_stream(stream_fields(info.config), desired)
                if plan.action == "update":
                    if plan.storage_mismatch:
                        log.warning("stream %s uses %s storage, wanted %s", name, *plan.storage_mismatch)
                    try:
                        await self.js.update_stream(StreamConfig(**plan.config))
                    except nats.js.errors.APIError as exc:
                        log.warning("could not reconcile stream %s: %s", name, exc)
            self._ensured.add(pool)

    async def _stream_gone(self, pool: str) -> bool:
        """Whether the pool's stream no longer exists, rather than being between two leaders (when
        publishes to it find no stream too): its info, asked with a short timeout, by one call per
        pool at a time. Not found: gone. An answer, an error or no answer: there (or unknown)."""
        return await asyncio.shield(
            _one_at_a_time(self._probing, pool, lambda: self._probe_stream(pool), f"probe-{pool}")
        )

    async def _probe_stream(self, pool: str) -> bool:
        try:
            await self._probe_js.stream_info(pool_stream_name(pool))
            return False
        except nats.js.errors.NotFoundError:
            return True
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.info("stream of pool %s not read (%s): taken as between two leaders", pool, exc)
            return False

    async def stream_pending(self, pool: str, *, fresh: bool = False) -> int:
        """Messages waiting in the pool stream, plus those admitted since it was read. Read at most once
        a quarter second (STREAM_INFO_TTL_S), by one stream-info call per pool at a time; a stale count
        answers at once while that call runs, unless ``fresh`` is asked for or it is older than
        STREAM_INFO_MAX_STALE_S (or there is none): then the caller waits for the call."""
        cached = self._pending_cache.get(pool)
        age = time.monotonic() - cached[0] if cached else float("inf")
        if cached and age < STREAM_INFO_TTL_S:
            return cached[1] + self._admitted_since.get(pool, 0)
        task = _one_at_a_time(self._refreshing, pool, lambda: self._read_pending(pool), f"stream-info-{pool}")
        if cached and age < STREAM_INFO_MAX_STALE_S and not fresh:
            return cached[1] + self._admitted_since.get(pool, 0)
        # shielded: a caller that gives up (its client went away) does not cancel the others' call
        return await asyncio.shield(task) + self._admitted_since.get(pool, 0)

    async def _read_pending(self, pool: str) -> int:
        now = time.monotonic()
        info = await self.js.stream_info(pool_stream_name(pool))
        pending = int(info.state.messages)
        self._pending_cache[pool] = (now, pending)
        self._admitted_since[pool] = 0
        return pending

    # ---- requests --------------------------------------------------------------------------
    async def check_capacity(
        self, pool: str, n_items: int, *, messages: int | None = None, priority: str = INTERACTIVE
    ) -> None:
        """Refuse a request the stream cannot take: too many items → 400, its ``messages`` (default:
        one per item) over the stream's room → 503 QUEUE_FULL.

        Bulk work may fill only ``bulk_share`` of the stream, so a bulk backlog never makes the
        stream refuse interactive work."""
        n_messages = n_items if messages is None else messages
        if n_items > self.max_stream_pending:
            raise SIEError(
                ErrorCode.INVALID_INPUT,
                f"Request has {n_items} items; split the request into batches of "
                f"{self.max_stream_pending} or fewer",
                param="items",
            )
        limit = (
            self.max_stream_pending if priority != BULK else int(self.max_stream_pending * self.bulk_share)
        )
        pending = await self.stream_pending(pool)
        if pending + n_messages > limit:  # a stale count only admits: a refusal reads the count anew
            pending = await self.stream_pending(pool, fresh=True)
        if pending + n_messages > limit:
            raise SIEError(
                ErrorCode.QUEUE_FULL,
                f"Queue for pool '{pool}' is full ({pending} messages pending); retry later",
                retry_after=self.queue_full_retry_after_s,
            )
        self._admitted_since[pool] = self._admitted_since.get(pool, 0) + n_messages

    async def cancel(self, request_id: str, reason: str) -> None:
        self.metrics.cancels.labels(reason).inc()
        try:
            await self.nc.publish(work_cancel_subject(self.router_id, request_id), reason.encode())
        except Exception as exc:
            log.debug("work_cancel publish failed: %s", exc)

    async def run(
        self,
        request_id: str,
        lane: Lane,
        model_id: str,
        messages: list[WorkMessage],
        *,
        operation: str,
        deadline: float,
        known: list[WorkResult | None] | None = None,
    ) -> list[WorkResult]:
        """Publish ``messages`` (the request's items, already carrying ids and reply subject, encoded
        once by the caller) and wait for every result. ``known`` holds the results of the request's
        items that are not published (cache hits) and ``None`` for each item the messages carry;
        without it the messages carry the whole request.

        ``deadline`` is a ``time.monotonic()`` instant. Raises SIEError on publish failure (the work is
        cancelled) or GATEWAY_TIMEOUT; cancellation of the caller (client gone) cancels the work.
        """
        if not self.nc.is_connected:
            raise SIEError(
                ErrorCode.QUEUE_UNAVAILABLE, "Work queue is not connected; retry later", retry_after=2
            )
        subject = work_subject(lane.pool, lane.machine_profile, lane.bundle, model_id, lane.priority)
        loop = asyncio.get_running_loop()
        n_items = sum(len(m.slots) for m in messages)
        slots: list[WorkResult | None] = list(known) if known is not None else [None] * n_items
        t0 = time.monotonic()
        col = Collector(
            len(slots),
            slots,
            loop.create_future(),
            subject=subject,
            sent=messages,
            request_id=request_id,
            lane=lane,
            progress_at=t0,
        )
        self._collectors[request_id] = col
        finished = False
        try:
            with tracing.span(
                "gateway.publish",
                attributes={"items": n_items, "messages": len(messages), "subject": subject},
            ):
                if self._leaderless and col.durable in self._leaderless:
                    await self._send_direct(col, messages)
                else:
                    timeout = max(0.001, min(self.publish_timeout_s, deadline - time.monotonic()))
                    await self._publish(
                        subject,
                        lane.pool,
                        [m.payload for m in messages],
                        [m.headers for m in messages],
                        timeout,
                        group=request_id,
                    )
            col.published = col.direct_at is None
            labelled(self.metrics.items_published, operation).inc(n_items)
            labelled(self.metrics.priority_items, lane.priority).inc(n_items)
            labelled(self.metrics.publish_seconds, operation).observe(time.monotonic() - t0)
            t1 = time.monotonic()
            # the deadline fails the request's own future (one timer; no task cancellation to undo)
            timer = loop.call_later(max(deadline - t1, 0.001), _expire, col.future)
            try:
                with tracing.span("gateway.collect"):
                    results = await col.future
            except TimeoutError:
                raise SIEError(
                    ErrorCode.GATEWAY_TIMEOUT,
                    f"No result within the gateway deadline ({col.total - col.remaining}/{col.total} items done)",
                ) from None
            finally:
                timer.cancel()
            labelled(self.metrics.result_wait_seconds, operation).observe(time.monotonic() - t1)
            finished = True
            return results
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                reason = "deadline" if time.monotonic() >= deadline else "abandoned"
                # shield: the caller may itself be cancelled (client disconnected)
                await asyncio.shield(self.cancel(request_id, reason))

    async def _publish(
        self,
        subject: str,
        pool: str,
        payloads: list[bytes],
        headers: list[dict[str, str]],
        timeout_s: float | None,
        group: str | None = None,
    ) -> None:
        """Publish a request's items (at most ``publish_window`` unacked at once) and wait for every ack,
        within ``timeout_s``. When no stream takes them: a stream between two leaders (it answers
        nothing while its members elect one, 4-9 s) gets them again, until the deadline (or until the
        request's items go on the direct path: ``group``); a stream found gone is ensured and gets
        them once more (``Nats-Msg-Id`` keeps an item already stored from being stored twice)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        ensured_again = False
        while True:
            remaining = deadline - loop.time() if deadline is not None else None
            if remaining is not None and remaining <= 0:
                raise _publish_timed_out()
            try:
                await self.publisher.publish_all(
                    subject, payloads, headers, window=self.publish_window, timeout_s=remaining, group=group
                )
                return
            except PublishAbandoned:
                return
            except TimeoutError:
                raise _publish_timed_out() from None
            except nats.js.errors.NoStreamResponseError:
                if not await self._stream_gone(pool):
                    if group is not None and self._went_direct(group):
                        return
                    continue
                # gone (NATS restarted with memory storage, or deleted): ensure it, send once more
                self._ensured.discard(pool)
                if ensured_again:
                    raise SIEError(
                        ErrorCode.QUEUE_UNAVAILABLE, "Work stream unavailable; retry later", retry_after=2
                    ) from None
                ensured_again = True
                await self.ensure_stream(pool)
            except nats.js.errors.APIError as exc:
                text = f"{exc.description or ''}".lower()
                if exc.err_code == 10077 or "maximum messages" in text or "maximum bytes" in text:
                    raise SIEError(
                        ErrorCode.QUEUE_FULL,
                        "Work queue is full; retry later",
                        retry_after=self.queue_full_retry_after_s,
                    ) from None
                raise SIEError(
                    ErrorCode.QUEUE_UNAVAILABLE,
                    f"Work queue refused the item: {exc.description}",
                    retry_after=2,
                ) from None
            except nats.errors.MaxPayloadError:
                raise SIEError(
                    ErrorCode.INVALID_INPUT,
                    "An item is larger than the work queue's message limit",
                    param="items",
                ) from None
            except (
                nats.errors.TimeoutError,
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.NoServersError,
                nats.errors.OutboundBufferLimitError,
            ):
                raise SIEError(
                    ErrorCode.QUEUE_UNAVAILABLE, "Work queue unavailable; retry later", retry_after=2
                ) from None

    def reply_subject(self, request_id: str) -> str:
        return reply_subject(self.router_id, request_id)

    def fail_item(self, request_id: str, item_index: int, code: str, message: str) -> bool:
        """Complete one item of a pending request with an error (e.g. dead-lettered). False if unknown."""
        col = self._collectors.get(request_id)
        if col is None:
            return False
        col.put(
            WorkResult.failure(
                ItemRef(work_item_id(request_id, item_index), request_id, item_index), code, message
            )
        )
        return True

    async def _on_result(self, msg: Msg) -> None:
        if msg.subject.startswith(self._taken_prefix):  # a sidecar took a message sent directly
            request_id, _, slot = msg.subject[len(self._taken_prefix) :].partition(".")
            col = self._collectors.get(request_id)
            if col is not None and slot.isdigit():
                col.untaken.discard(int(slot))
            return
        if msg.subject == self.results_subject:
            try:
                results = unpack_results(msg.data)
            except Exception as exc:
                log.warning("dropping a malformed results message: %s", exc)
                return
            for result in results:
                if result.result_ref is None:
                    self._deliver(result.request_id, result)
                else:
                    await self._deliver_resolved(result.request_id, result)
            return
        request_id = msg.subject.rsplit(".", 1)[-1]
        if request_id not in self._collectors:  # decided before decoding: late or duplicate
            self.metrics.inbox_skips.inc()
            return
        try:
            result = WorkResult.from_msgpack(msg.data)
        except Exception as exc:
            log.warning("dropping malformed result for %s: %s", request_id, exc)
            return
        await self._deliver_resolved(request_id, result)

    async def _deliver_resolved(self, request_id: str, result: WorkResult) -> None:
        """Deliver ``result``, read first from the payload store when it was too large to travel."""
        ref = result.result_ref
        if ref is not None:
            if request_id not in self._collectors:
                self.metrics.inbox_skips.inc()
                return
            try:
                result = WorkResult.from_msgpack(await self.payloads.get(ref))
            except Exception as exc:  # noqa: BLE001 - gone, or the store unreachable: the item fails
                log.warning("result %s of %s not read from the payload store: %s", ref, request_id, exc)
                result = dataclasses.replace(
                    result,
                    success=False,
                    error_code=ErrorCode.INTERNAL_ERROR.value,
                    error=f"the result was too large for one message and could not be read back ({exc})",
                    result_ref=None,
                )
            else:
                with contextlib.suppress(Exception):
                    await self.payloads.delete(ref)
        self._deliver(request_id, result)

    def _deliver(self, request_id: str, result: WorkResult) -> None:
        col = self._collectors.get(request_id)
        if col is None:
            self.metrics.inbox_skips.inc()
            return
        col.put(result)


def _one_at_a_time(
    calls: dict[str, asyncio.Task[T]], key: str, call: Callable[[], Awaitable[T]], name: str
) -> asyncio.Task[T]:
    """The call under way for ``key`` in ``calls``, or a new one started there: at most one per key
    at a time, forgotten as it ends. Its outcome is retrieved even when nobody waits for it (callers
    await it shielded, so one that gives up does not cancel the others' call)."""
    task = calls.get(key)
    if task is None:

        async def run() -> T:
            try:
                return await call()
            finally:
                calls.pop(key, None)

        task = asyncio.get_running_loop().create_task(run(), name=name)
        task.add_done_callback(_retrieved)
        calls[key] = task
    return task


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _publish_timed_out() -> SIEError:
    return SIEError(ErrorCode.QUEUE_UNAVAILABLE, "Publishing work timed out; retry later", retry_after=2)
