"""Publishing a request's items: at most a window unacknowledged at once, one timeout for all, a
publish whose ack died with the NATS connection sent again at the reconnect, and what the direct path
sends again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import nats
import pytest

from gateway.direct import DIRECT_RESEND_S, DIRECT_TAKE_S
from gateway.pending import Collector
from gateway.routing import Lane
from protocol.errors import ErrorCode, SIEError
from protocol.jobs import ItemRef
from protocol.subjects import direct_subject, pool_stream_name, work_subject
from protocol.work import WorkResult
from protocol.work_codec import H_TAKEN, WorkCodec, WorkMessage
from tests.support.jobs import encode_job, encode_messages
from tests.support.polling import wait_until


class NoLeaders:
    """A lane's leaders as they look during an election (this one server would name them)."""

    async def missing(self, lane: Lane) -> str | None:
        return "an election"


async def test_a_publish_lost_with_the_server_is_sent_again_at_the_reconnect(nats_server, dispatcher):
    async def reconnected() -> None:
        d.on_reconnect()

    reconnecting = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.2, "reconnected_cb": reconnected}
    d = await dispatcher(connect=reconnecting, storage="file", publish_timeout_s=30.0)
    await d.streams.ensure_stream("default")
    subject = work_subject("default", "cpu", "default", "m")
    assert nats_server.proc is not None
    nats_server.pause()  # the publish reaches a server that never answers
    publish = asyncio.create_task(
        d.publish(subject, "default", [b"payload"], [{"Nats-Msg-Id": "item-1"}], None)
    )
    await asyncio.sleep(0.5)
    assert not publish.done()
    os.kill(nats_server.proc.pid, signal.SIGKILL)  # ... and dies with it unread
    nats_server.proc.wait(5)
    nats_server.start()  # same port, same store: the stream is still there
    await asyncio.wait_for(publish, 10.0)  # far inside the 30 s publish timeout
    info = await d.nc.jetstream().stream_info(pool_stream_name("default"))
    assert info.state.messages == 1


async def test_a_requests_items_wait_for_their_acks_at_most_a_window_at_a_time(nats_server, dispatcher):
    """The gateway sends a request's items without a task each: no more than the window goes
    unacknowledged; the rest follow as acks come in, and every item is stored once."""
    d = await dispatcher(storage="file", publish_concurrency=3)
    nc = d.nc
    await d.streams.ensure_stream("default")
    subject = work_subject("default", "cpu", "default", "m")
    payloads = [b"item %d" % i for i in range(10)]
    headers = [{"Nats-Msg-Id": f"win-{i}"} for i in range(10)]
    sent = nc.stats["out_msgs"]
    nats_server.pause()  # no acks while it is stopped
    try:
        publish = asyncio.create_task(d.publish(subject, "default", payloads, headers, 30.0))
        await asyncio.sleep(0.3)
        assert not publish.done()
        assert nc.stats["out_msgs"] - sent == 3
    finally:
        nats_server.resume()
    await asyncio.wait_for(publish, 10.0)
    assert nc.stats["out_msgs"] - sent == 10
    assert d.publisher.in_flight == 0
    info = await nc.jetstream().stream_info(pool_stream_name("default"))
    assert info.state.messages == 10


async def test_acks_that_do_not_come_in_time_fail_the_publish_and_leave_nothing_pending(
    nats_server, dispatcher
):
    d = await dispatcher(storage="file", publish_concurrency=2)
    await d.streams.ensure_stream("default")
    subject = work_subject("default", "cpu", "default", "m")
    nats_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(SIEError) as err:
            await d.publish(
                subject,
                "default",
                [b"a", b"b", b"c"],
                [{"Nats-Msg-Id": f"late-{i}"} for i in range(3)],
                0.3,
            )
        assert err.value.code == ErrorCode.QUEUE_UNAVAILABLE
        assert time.monotonic() - t0 >= 0.29  # it waited for the acks as long as the timeout said
        assert d.publisher.in_flight == 0  # nothing left for a resend after a reconnect
    finally:
        nats_server.resume()


async def test_a_publish_nobody_answers_yet_is_sent_again_until_its_stream_takes_it(dispatcher):
    """On a JetStream cluster a stream whose leader died takes nothing until one is elected: the
    publish is sent again every ``resend_after_s``, a "no responders" answer is final only after the
    grace, and once the stream answers the publish is acknowledged, stored once."""
    d = await dispatcher(publish_timeout_s=20.0)
    nc = d.nc
    d.publisher.resend_after_s = 0.2
    subject = work_subject("default", "cpu", "default", "m")
    publish = asyncio.ensure_future(
        d.publisher.publish_all(subject, [b"x"], [{"Nats-Msg-Id": "later-0"}], window=4, timeout_s=20.0)
    )
    # no stream yet: answered "no responders", and sent again
    await wait_until(lambda: d.publisher.resent >= 3, 20, what="re-sends while no stream answers")
    assert not publish.done()
    await d.streams.ensure_stream("default")  # the stream appears (a leader elected)
    await asyncio.wait_for(publish, 20)
    js = nc.jetstream()
    assert (await js.stream_info(pool_stream_name("default"))).state.messages == 1


async def test_a_publish_to_a_stream_that_is_gone_recreates_it_and_is_stored(dispatcher):
    """A publish that finds no stream is sent again while the stream is only between two leaders;
    when the stream is gone (here deleted; a NATS restart with memory storage does the same) the
    gateway creates it again and the items are stored."""
    d = await dispatcher()
    nc = d.nc
    d.publisher.no_stream_grace_s = 0.0  # the grace for an election: nothing to wait out here
    await d.streams.ensure_stream("default")
    js = nc.jetstream()
    await js.delete_stream(pool_stream_name("default"))
    subject = work_subject("default", "cpu", "default", "m")
    await d.publish(subject, "default", [b"payload"], [{"Nats-Msg-Id": "item-0"}], 5.0)
    assert (await js.stream_info(pool_stream_name("default"))).state.messages == 1


async def test_a_publish_that_finds_no_stream_while_it_exists_is_sent_again_until_stored(dispatcher):
    """What a stream between two leaders looks like to a publish: no stream takes its subject, while
    the stream's info still answers. The publish is sent again, and stored once a stream takes it
    (here: once the stream that captures its subject is created), instead of failing."""
    d = await dispatcher()
    nc = d.nc
    d.publisher.resend_after_s, d.publisher.no_stream_grace_s = 0.1, 0.05
    await d.streams.ensure_stream("default")  # what the probe reads: the stream is there
    subject = work_subject("later", "cpu", "default", "m")  # no stream takes it yet
    publish = asyncio.ensure_future(
        d.publish(subject, "default", [b"payload"], [{"Nats-Msg-Id": "item-0"}], 10.0)
    )
    await asyncio.sleep(0.5)
    assert not publish.done()
    await d.streams.ensure_stream("later")
    await asyncio.wait_for(publish, 5.0)
    assert (await nc.jetstream().stream_info(pool_stream_name("later"))).state.messages == 1


async def test_after_a_reconnect_items_still_unanswered_are_dispatched_again(dispatcher):
    """A result published while the gateway was cut off is lost (core NATS keeps nothing): after the
    reconnect each stored item of a request still waiting goes out again under a new message id,
    and an item already answered does not."""
    d = await dispatcher()
    nc = d.nc
    await d.streams.ensure_stream("default")
    subject = work_subject("default", "cpu", "default", "m")
    loop = asyncio.get_running_loop()
    answered = [WorkResult.failure(ItemRef(f"w-{i}", "r", i), "X", "answered before the cut") for i in (1, 3)]
    col = Collector(
        5,
        [None, answered[0], None, answered[1], answered[1]],
        loop.create_future(),
        subject=subject,
        request_id="r",
    )
    col.sent = [
        WorkMessage((0,), b"item-0", {"Nats-Msg-Id": "w-0"}),
        WorkMessage((1,), b"item-1", {"Nats-Msg-Id": "w-1"}),
        WorkMessage((2, 3), b"chunk-2-3", {"Nats-Msg-Id": "w-2+2"}),  # one item of it answered
        WorkMessage((4,), b"item-4", {"Nats-Msg-Id": "w-4"}),
    ]
    d.pending.add(col)
    assert (
        await d.redispatcher.redispatch() == 0
    )  # not yet acknowledged: the publisher's own resend covers it
    col.published = True
    assert await d.redispatcher.redispatch() == 3  # the lone item and the chunk of two
    col.results[2] = answered[1]
    assert await d.redispatcher.redispatch() == 1
    js = nc.jetstream()
    sub = await js.pull_subscribe(subject, durable="check", stream=pool_stream_name("default"))
    msgs = await sub.fetch(10, timeout=2)
    assert [(m.data, m.headers["Nats-Msg-Id"]) for m in msgs] == [
        (b"item-0", "w-0~1"),
        (b"chunk-2-3", "w-2+2~1"),
        (b"item-0", "w-0~2"),
    ]
    # the sidecar reads the items from the other headers: the message id's mark changes nothing
    [sent] = encode_messages(encode_job("w", 1), ["x"])
    assert WorkCodec.routes(sent.again(2)) == WorkCodec.routes(sent.headers)


async def test_a_message_sent_directly_that_no_sidecar_took_is_sent_again_soon(nats_server, dispatcher):
    """Nothing keeps a message on the direct path: one sent while the lane's sidecars were cut off
    (or into a connection that had died unnoticed) is lost. A sidecar says it took one (the subject
    in its ``Sie-Taken`` header); what none took goes again after DIRECT_TAKE_S, what one took only
    after DIRECT_RESEND_S without a result, and then only the messages still missing a result."""
    d = await dispatcher(leaders=NoLeaders())
    await d.start()  # the inbox subscription that hears results and takes
    lane = Lane("default", "cpu", "default")
    subject = work_subject("default", "cpu", "default", "m")
    loop = asyncio.get_running_loop()
    col = Collector(3, [None, None, None], loop.create_future(), subject=subject, request_id="r", lane=lane)
    col.sent = [
        WorkMessage((0,), b"item-0", {"Nats-Msg-Id": "w-0"}),
        WorkMessage((1, 2), b"chunk-1-2", {"Nats-Msg-Id": "w-1+2"}),
    ]
    col.progress_at = time.monotonic()
    d.pending.add(col)
    assert await d.direct.check_lane(lane)  # what the probe finds during an election
    await d.direct.send(col, col.missing())  # no sidecar listens yet: lost
    await d.nc.flush()
    assert col.untaken == {0, 1}

    got: list[bytes] = []
    sidecar = await nats.connect(nats_server.url)

    async def take(msg) -> None:
        got.append(msg.data)
        await sidecar.publish(msg.headers[H_TAKEN], b"")

    try:
        await sidecar.subscribe(direct_subject(subject), queue=col.durable, cb=take)
        await sidecar.flush()
        sent_at = col.direct_at
        assert sent_at is not None
        await d.direct.look_for_stalls(sent_at + DIRECT_TAKE_S - 0.1)
        await d.nc.flush()
        await asyncio.sleep(0.2)
        assert got == []  # not yet due
        await d.direct.look_for_stalls(sent_at + DIRECT_TAKE_S)
        await wait_until(lambda: not col.untaken, 5, what="both messages taken")
        assert sorted(got) == [b"chunk-1-2", b"item-0"]

        # taken: not sent again while the sidecar works on them ...
        sent_at = col.direct_at
        assert sent_at is not None
        await d.direct.look_for_stalls(sent_at + DIRECT_RESEND_S - 0.1)
        await d.nc.flush()
        await asyncio.sleep(0.2)
        assert len(got) == 2
        # ... until one has no result for DIRECT_RESEND_S (its sidecar may have died)
        col.put(WorkResult.failure(ItemRef("w-0", "r", 0), "X", "answered"))
        await d.direct.look_for_stalls(time.monotonic() + DIRECT_RESEND_S)
        await wait_until(lambda: len(got) == 3, 5, what="the unanswered chunk sent again")
        assert got[2] == b"chunk-1-2"
    finally:
        await sidecar.close()
        await d.stop()


async def test_a_message_sent_directly_that_no_sidecar_took_goes_to_the_stream_once_it_has_a_leader(
    dispatcher,
):
    """The lane's leaders came back before a sidecar took what was sent directly: what is missing
    goes to the stream after DIRECT_TAKE_S, not after DIRECT_RESEND_S."""
    d = await dispatcher()
    await d.streams.ensure_stream("default")
    lane = Lane("default", "cpu", "default")
    subject = work_subject("default", "cpu", "default", "m")
    col = Collector(
        1, [None], asyncio.get_running_loop().create_future(), subject=subject, request_id="r", lane=lane
    )
    col.sent = [WorkMessage((0,), b"item-0", {"Nats-Msg-Id": "w-0"})]
    col.progress_at = time.monotonic()
    d.pending.add(col)
    await d.direct.send(col, col.missing())  # nobody takes it; the lane is not (any longer) leaderless
    sent_at = col.direct_at
    assert sent_at is not None
    await d.direct.look_for_stalls(sent_at + DIRECT_TAKE_S)
    assert col.direct_at is None and not col.untaken
    sub = await d.nc.jetstream().pull_subscribe(subject, durable="check", stream=pool_stream_name("default"))
    msgs = await sub.fetch(1, timeout=5)
    assert [(m.data, m.headers["Nats-Msg-Id"]) for m in msgs] == [(b"item-0", "w-0~1")]
