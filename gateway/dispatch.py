"""Running a request's work: its messages published to JetStream (or sent on the direct path), its
results collected from the gateway's inbox, within the request's deadline.

One :class:`Dispatcher` per gateway process: it owns the ``router_id`` (the inbox namespace) and
composes the parts that do the work: the pool streams (:mod:`gateway.streams`), the table of
pending requests (:mod:`gateway.pending`), the result inbox (:mod:`gateway.inbox`), sending again
after a reconnect (:mod:`gateway.redispatch`) and the direct path (:mod:`gateway.direct`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from gateway.direct import DirectPath, JetStreamLeaders, LaneLeaders
from gateway.inbox import ResultInbox
from gateway.metrics import GatewayMetrics, labelled
from gateway.pending import Collector, PendingRequests
from gateway.publisher import AckedPublisher, PublishAbandoned
from gateway.redispatch import Redispatcher, Resender
from gateway.routing import Lane
from gateway.streams import STREAM_PROBE_TIMEOUT_S, StreamAdmin
from iokit.payloads import PayloadStore
from protocol import tracing
from protocol.errors import ErrorCode, SIEError
from protocol.subjects import work_cancel_subject, work_subject
from protocol.work import WorkResult
from protocol.work_codec import WorkMessage

log = logging.getLogger(__name__)


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
        leaders: LaneLeaders | None = None,
    ) -> None:
        self.nc = nc
        self.metrics = metrics
        self.router_id = router_id or str(uuid.uuid4())
        self.publish_timeout_s = publish_timeout_s
        self.streams = StreamAdmin(
            nc.jetstream(),
            nc.jetstream(timeout=STREAM_PROBE_TIMEOUT_S),
            storage=storage,
            max_age_s=max_age_s,
            max_msgs=max_msgs,
            replicas=replicas,
            max_stream_pending=max_stream_pending,
            queue_full_retry_after_s=queue_full_retry_after_s,
            bulk_share=bulk_share,
        )
        # work items and results over the NATS max payload (iokit.payloads)
        self.payloads = PayloadStore(nc.jetstream(), storage=storage, replicas=replicas, max_age_s=max_age_s)
        self.pending = PendingRequests()
        self.inbox = ResultInbox(nc, self.router_id, self.pending, self.payloads, skips=metrics.inbox_skips)
        self.publisher = AckedPublisher(nc)
        # a request's items waiting for their acks at once
        self.resender = Resender(self.publisher, window=publish_concurrency, timeout_s=publish_timeout_s)
        # the direct path, with replicated streams only (one server has no election to wait out)
        self.direct = DirectPath(
            nc,
            self.router_id,
            self.pending,
            self.publisher,
            self.resender,
            sent_items=metrics.direct_items,
            after_s=direct_after_s if replicas > 1 else 0.0,
            leaders=leaders or JetStreamLeaders(nc),
        )
        self.redispatcher = Redispatcher(self.pending, self.resender, self.direct)

    async def start(self) -> None:
        await self.inbox.start()
        await self.publisher.start()
        self.direct.start()

    async def stop(self) -> None:
        await self.direct.stop()
        await self.inbox.stop()
        self.pending.cancel_all()
        await self.publisher.stop()

    def on_reconnect(self) -> None:
        """After a NATS reconnect publishes still waiting for their ack (the publish or its ack may
        have died with the old connection) are sent again at once rather than after their timeout,
        and so are the messages of requests whose results may have been lost (Redispatcher)."""
        self.streams.on_reconnect()
        self.resender.background(self.publisher.resend())
        self.resender.background(self.redispatcher.redispatch())

    @property
    def pending_requests(self) -> int:
        return len(self.pending)

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
        self.pending.add(col)
        finished = False
        try:
            with tracing.span(
                "gateway.publish",
                attributes={"items": n_items, "messages": len(messages), "subject": subject},
            ):
                if self.direct.leaderless(col.durable):
                    await self.direct.send(col, messages)
                else:
                    timeout = max(0.001, min(self.publish_timeout_s, deadline - time.monotonic()))
                    await self.publish(
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
            self.pending.remove(request_id)
            if not finished:
                reason = "deadline" if time.monotonic() >= deadline else "abandoned"
                # shield: the caller may itself be cancelled (client disconnected)
                await asyncio.shield(self.cancel(request_id, reason))

    async def publish(
        self,
        subject: str,
        pool: str,
        payloads: list[bytes],
        headers: list[dict[str, str]],
        timeout_s: float | None,
        group: str | None = None,
    ) -> None:
        """Publish a request's items (at most the resender's window unacked at once) and wait for
        every ack, within ``timeout_s``. When no stream takes them: a stream between two leaders (it
        answers nothing while its members elect one, 4-9 s) gets them again, until the deadline (or
        until the request's items go on the direct path: ``group``); a stream found gone is ensured
        and gets them once more (``Nats-Msg-Id`` keeps an item already stored from being stored twice)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        ensured_again = False
        while True:
            remaining = deadline - loop.time() if deadline is not None else None
            if remaining is not None and remaining <= 0:
                raise _publish_timed_out()
            try:
                await self.publisher.publish_all(
                    subject, payloads, headers, window=self.resender.window, timeout_s=remaining, group=group
                )
                return
            except PublishAbandoned:
                return
            except TimeoutError:
                raise _publish_timed_out() from None
            except nats.js.errors.NoStreamResponseError:
                if not await self.streams.gone(pool):
                    if group is not None and self.direct.went_direct(group):
                        return
                    continue
                # gone (NATS restarted with memory storage, or deleted): ensure it, send once more
                self.streams.forget(pool)
                if ensured_again:
                    raise SIEError(
                        ErrorCode.QUEUE_UNAVAILABLE, "Work stream unavailable; retry later", retry_after=2
                    ) from None
                ensured_again = True
                await self.streams.ensure_stream(pool)
            except nats.js.errors.APIError as exc:
                raise _refused(exc, self.streams.queue_full_retry_after_s) from None
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


def _refused(exc: nats.js.errors.APIError, queue_full_retry_after_s: float) -> SIEError:
    """The error of a publish the stream refused: QUEUE_FULL at its limits, else QUEUE_UNAVAILABLE."""
    text = f"{exc.description or ''}".lower()
    if exc.err_code == 10077 or "maximum messages" in text or "maximum bytes" in text:
        return SIEError(
            ErrorCode.QUEUE_FULL, "Work queue is full; retry later", retry_after=queue_full_retry_after_s
        )
    return SIEError(
        ErrorCode.QUEUE_UNAVAILABLE, f"Work queue refused the item: {exc.description}", retry_after=2
    )


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _publish_timed_out() -> SIEError:
    return SIEError(ErrorCode.QUEUE_UNAVAILABLE, "Publishing work timed out; retry later", retry_after=2)
