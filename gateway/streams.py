"""The pool work streams as the gateway sees them: ensured with the operator's settings, probed when
a publish finds none, and counted for admission (QUEUE_FULL)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from gateway.calls import one_at_a_time
from protocol.errors import ErrorCode, SIEError
from protocol.streams import reconcile_stream, stream_config, stream_fields
from protocol.subjects import BULK, INTERACTIVE, pool_stream_name

log = logging.getLogger(__name__)

STREAM_INFO_TTL_S = 0.25
# Past its TTL the cached count still answers, while one call refreshes it beside the requests
# (waiting for that call put its latency, 80-200 ms with a batch loading NATS, on every fourth of a
# second's first request; while the stream elects a new leader, 4-9 s, the call fails, and the
# request with it, where the publish would have waited out the election). A stale count plus what
# was admitted since only overestimates the queue. Past this age requests wait for the call again.
STREAM_INFO_MAX_STALE_S = 15.0
STREAM_PROBE_TIMEOUT_S = 1.0


class StreamAdmin:
    """The pool streams of one gateway: which it has ensured, their cached message counts, and the
    admission check that reads them."""

    def __init__(
        self,
        js: JetStreamContext,
        probe_js: JetStreamContext,
        *,
        storage: str = "file",
        max_age_s: float = 1800.0,
        max_msgs: int = 100_000,
        replicas: int = 1,
        max_stream_pending: int = 50_000,
        queue_full_retry_after_s: float = 1.0,
        bulk_share: float = 1.0,
    ) -> None:
        self.js = js
        # whether a stream that took no publish is gone: asked with a timeout shorter than a request's
        self._probe_js = probe_js
        self.storage = storage
        self.max_age_s = max_age_s
        self.max_msgs = max_msgs
        self.replicas = replicas
        self.max_stream_pending = max_stream_pending
        self.queue_full_retry_after_s = queue_full_retry_after_s
        self.bulk_share = bulk_share
        self._ensured: set[str] = set()
        self._ensure_locks: dict[str, asyncio.Lock] = {}
        self._pending_cache: dict[str, tuple[float, int]] = {}
        # items admitted since the cached stream count was read: a burst inside one cache period
        # cannot overshoot max_stream_pending
        self._admitted_since: dict[str, int] = {}
        # the stream-info call under way per pool: requests that find the count stale start no other
        # (and wait for it only when the count is too old to answer; stream_pending)
        self._refreshing: dict[str, asyncio.Task[int]] = {}
        # whether a stream that took no publish is gone (gone): one call per pool at a time
        self._probing: dict[str, asyncio.Task[bool]] = {}

    def on_reconnect(self) -> None:
        """A single server may have come back without its streams (memory storage): they are
        ensured again and counted anew. Streams replicated over several members outlive a member;
        their count stays (a request waiting for a stream's info would wait out its election)."""
        if self.replicas == 1:
            self._ensured.clear()
            self._pending_cache.clear()

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

    def forget(self, pool: str) -> None:
        """The pool's stream was found gone: the next :meth:`ensure_stream` creates it again."""
        self._ensured.discard(pool)

    async def gone(self, pool: str) -> bool:
        """Whether the pool's stream no longer exists, rather than being between two leaders (when
        publishes to it find no stream too): its info, asked with a short timeout, by one call per
        pool at a time. Not found: gone. An answer, an error or no answer: there (or unknown)."""
        return await asyncio.shield(
            one_at_a_time(self._probing, pool, lambda: self._probe_stream(pool), f"probe-{pool}")
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
        task = one_at_a_time(self._refreshing, pool, lambda: self._read_pending(pool), f"stream-info-{pool}")
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
