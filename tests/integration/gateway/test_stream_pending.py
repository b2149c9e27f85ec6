"""The gateway's admission check reads the pool stream's message count once per cache period, however
many requests arrive while the cached count is stale, and a stale count answers while it is read."""

from __future__ import annotations

import asyncio
import time

import nats
import nats.js.errors
import pytest

from gateway import streams
from gateway.dispatch import Dispatcher
from protocol.errors import ErrorCode, SIEError
from protocol.subjects import pool_stream_name, work_subject


async def stored(d: Dispatcher, n: int) -> None:
    """``n`` items published to the default pool's stream, created first."""
    await d.streams.ensure_stream("default")
    subject = work_subject("default", "cpu", "default", "m")
    await d.publish(
        subject, "default", [b"payload"] * n, [{"Nats-Msg-Id": f"item-{i}"} for i in range(n)], None
    )


async def test_requests_that_find_the_count_stale_share_one_stream_info_call(dispatcher):
    d = await dispatcher()
    nc = d.nc
    await stored(d, 2)

    def sent() -> int:
        """Messages this connection has sent: here, only stream-info requests."""
        return nc.stats["out_msgs"]

    before = sent()
    counts = await asyncio.gather(*(d.streams.stream_pending("default") for _ in range(20)))
    assert counts == [2] * 20
    # admitted items count on top of the cached figure until the next read
    await d.streams.check_capacity("default", 3)
    assert await d.streams.stream_pending("default") == 5
    assert sent() - before == 1

    await asyncio.sleep(streams.STREAM_INFO_TTL_S + 0.05)
    before = sent()
    # past its TTL the count answers at once (2 stored + 3 admitted, then one more per request)
    # while one call reads it again: nobody waits for that call
    assert await asyncio.gather(*(d.streams.stream_pending("default") for _ in range(20))) == [5] * 20
    await d.streams.check_capacity("default", 1)
    assert await d.streams.stream_pending("default") == 6
    assert sent() - before == 1
    while await d.streams.stream_pending("default") != 2:  # the call's answer: 2 stored, admitted reset
        await asyncio.sleep(0.01)


async def test_a_count_older_than_the_staleness_bound_is_read_before_it_answers(dispatcher):
    d = await dispatcher()
    await stored(d, 1)
    assert await d.streams.stream_pending("default") == 1
    # a count read long ago (the stream-info calls failed or hung since) no longer answers
    d.streams._pending_cache["default"] = (time.monotonic() - streams.STREAM_INFO_MAX_STALE_S - 1, 99)
    assert await d.streams.stream_pending("default") == 1


async def test_a_failed_stream_info_call_fails_every_waiting_request_and_the_next_one_asks_again(dispatcher):
    d = await dispatcher()
    got = await asyncio.gather(
        *(d.streams.stream_pending("nowhere") for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(g, nats.js.errors.NotFoundError) for g in got), got
    await d.streams.ensure_stream("nowhere")
    assert await d.streams.stream_pending("nowhere") == 0


async def test_a_stale_count_that_would_refuse_a_request_is_read_again_first(dispatcher):
    d = await dispatcher(max_stream_pending=3)
    nc = d.nc
    await stored(d, 2)
    assert await d.streams.stream_pending("default") == 2
    await nc.jetstream().purge_stream(pool_stream_name("default"))  # the workers took both
    await asyncio.sleep(streams.STREAM_INFO_TTL_S + 0.05)
    # the stale count (2) would refuse 2 more items; the stream, read again, takes them
    await d.streams.check_capacity("default", 2)
    assert await d.streams.stream_pending("default") == 2
    # a refusal stands on a fresh count: 2 admitted, 2 more do not fit
    with pytest.raises(SIEError) as refused:
        await d.streams.check_capacity("default", 2)
    assert refused.value.code == ErrorCode.QUEUE_FULL
