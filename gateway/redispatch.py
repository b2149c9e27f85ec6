"""Sending a request's messages again: after a reconnect (their results may have been lost with
the old connection), and for the direct path (:mod:`gateway.direct`) once a lane has its leaders."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from gateway.pending import Collector, PendingRequests
from gateway.publisher import AckedPublisher
from protocol.work_codec import WorkMessage

log = logging.getLogger(__name__)


class Resender:
    """Publishes a request's messages to its stream again, under new message ids."""

    def __init__(self, publisher: AckedPublisher, *, window: int, timeout_s: float) -> None:
        self.publisher = publisher
        self.window = window  # a request's items waiting for their acks at once
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def send_again(self, col: Collector, missing: list[WorkMessage]) -> Awaitable[None]:
        """Publish ``missing`` (messages of ``col``) to the stream again under new message ids."""
        col.redispatches += 1
        return self.publisher.publish_all(
            col.subject,
            [m.payload for m in missing],
            [m.again(col.redispatches) for m in missing],
            window=self.window,
            timeout_s=self.timeout_s,
        )

    def background(self, work: Awaitable[Any]) -> None:
        """Send items again beside the requests, kept until done; a failure is logged (each
        request's own deadline answers for its items)."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:  # noqa: BLE001 - the request's deadline answers for it
                log.warning("sending unanswered items again failed: %s", exc)

        task = asyncio.get_running_loop().create_task(run(), name="send-again")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class DirectSender(Protocol):
    def leaderless(self, durable: str) -> bool: ...

    async def send(self, col: Collector, missing: list[WorkMessage]) -> None: ...


class Redispatcher:
    """After a reconnect: each request's messages that carry an item without a result, sent again."""

    def __init__(self, pending: PendingRequests, resender: Resender, direct: DirectSender) -> None:
        self.pending = pending
        self.resender = resender
        self.direct = direct

    async def redispatch(self) -> int:
        """Publish again each stored message of a request in flight that carries an item whose
        result has not come, under a new ``Nats-Msg-Id``; returns how many items those messages
        carry. A result the sidecar published while this gateway was cut off (its member stopped or
        partitioned away, unnoticed until its pings went unanswered) went to a connection that no
        longer reads: core NATS keeps nothing. An item still being worked on runs twice; the first
        result fills its slot."""
        sends = []
        count = 0
        for col in self.pending.snapshot():
            if not (col.published or col.direct_at is not None) or col.future.done():
                continue
            missing = col.missing()
            if not missing:
                continue
            count += sum(len(m.slots) for m in missing)
            if col.direct_at is not None and self.direct.leaderless(col.durable):
                await self.direct.send(col, missing)
                continue
            sends.append(self.resender.send_again(col, missing))
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.warning("re-dispatching unanswered items after a reconnect failed: %s", outcome)
        if count:
            log.info(
                "re-dispatched %d unanswered item(s) of %d request(s) after a reconnect", count, len(sends)
            )
        return count
