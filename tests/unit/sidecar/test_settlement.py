"""Settlement alone, against a real nats-server: the rows of the settlement table in
``sidecar.lane`` that are Settlement's own, each checked where NATS shows it (the reply inbox, the
consumer's ack state, the DLQ stream)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StreamConfig

from iokit.payloads import PayloadStore
from protocol import ipc
from protocol.codec import unpackb
from protocol.errors import ErrorCode
from protocol.streams import dlq_stream_config, stream_config
from protocol.subjects import DLQ_REASON_HEADER, DLQ_STREAM, results_subject, work_subject
from protocol.work import WorkResult
from protocol.work_codec import WorkCodec
from sidecar.deliveries import Delivery, Held, Lease, ModelScheduler, leases_of
from sidecar.settlement import Settlement
from tests.support.clock import ManualClock
from tests.support.jobs import encode_job, encode_messages
from tests.support.polling import wait_until
from tests.unit.sidecar.parts import MODEL
from tests.unit.sidecar.parts import delivery as make_delivery

SUBJECT = work_subject("default", "cpu", "default", MODEL)
STREAM = "WORK_POOL_default"
INBOX = "_INBOX.router"


@dataclass
class Rig:
    nc: Client
    js: JetStreamContext
    settlement: Settlement
    held: Held
    stats: dict[str, int]
    replies: list[Msg]
    sub: JetStreamContext.PullSubscription

    async def delivery(self, *, results: bool = False, request_id: str | None = None) -> Delivery:
        """Publish one work message and pull it: a held delivery with JetStream metadata."""
        request_id = request_id or f"r{next(_requests)}"  # a message id of its own
        d = make_delivery(0.0, request_id=request_id)
        [msg] = messages(request_id, 1, results_subject("router") if results else None)
        await self.js.publish(SUBJECT, msg.payload, headers=msg.headers)
        (got,) = await self.sub.fetch(1, timeout=10)
        d.lease = Lease(got)
        [d.route] = WorkCodec.routes(got.headers)
        self.held.add(d)
        return d

    async def chunk(self, n: int, request_id: str = "c") -> list[Delivery]:
        """Publish one message carrying ``n`` items of a request and pull it: its held deliveries,
        one per item, under one lease (as intake makes them)."""
        [msg] = messages(request_id, n)
        await self.js.publish(SUBJECT, msg.payload, headers=msg.headers)
        (got,) = await self.sub.fetch(1, timeout=10)
        routes = WorkCodec.routes(got.headers)
        lease = Lease(got, open=len(routes))
        shared, owns = WorkCodec.split(got.data, len(routes))
        ds = []
        for route, body in zip(routes, owns, strict=True):
            d = make_delivery(0.0)
            d.lease, d.body, d.shared, d.route = lease, body, shared, route
            self.held.add(d)
            ds.append(d)
        return ds

    async def settled(self) -> None:
        """Until the server has every settlement sent so far: nothing delivered or pending."""

        async def done() -> bool:
            info = await self.js.consumer_info(STREAM, "lane")
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_until(done, 10, what="the consumer settled")

    async def replies_so_far(self) -> list[Msg]:
        """The replies published before now (a marker sent after them arrives after them)."""
        marker = f"{INBOX}.marker"
        await self.nc.publish(marker, b"")
        await wait_until(lambda: any(m.subject == marker for m in self.replies), 10, what="the marker")
        at = next(i for i, m in enumerate(self.replies) if m.subject == marker)
        before, self.replies[: at + 1] = self.replies[:at], []
        return before


_requests = itertools.count()


def messages(request_id: str, n: int, results: str | None = None) -> list:
    """The work message of ``n`` items of a request, as the gateway publishes it."""
    job = encode_job(request_id, n, model_id=MODEL, reply_subject=f"{INBOX}.{request_id}", timestamp=0.0)
    return encode_messages(job, ["t" * i for i in range(n)], results_subject=results)


def results_of(msg: Msg) -> list[WorkResult]:
    return WorkCodec.results(msg.data)


@asynccontextmanager
async def rig(nats_server, *, payloads: bool = False) -> AsyncIterator[Rig]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(**stream_config("default", storage="memory")))
    await js.add_stream(StreamConfig(**dlq_stream_config(storage="memory")))
    await js.add_consumer(STREAM, ConsumerConfig(durable_name="lane", ack_policy="explicit", ack_wait=30))
    replies: list[Msg] = []

    async def on_reply(msg: Msg) -> None:
        replies.append(msg)

    await nc.subscribe(f"{INBOX}.>", cb=on_reply)
    held, stats = (
        Held(),
        dict.fromkeys(("published", "acked", "naked", "dropped", "progress", "dead_lettered"), 0),
    )
    settlement = Settlement(
        nc,
        js,
        payloads=PayloadStore(js, storage="memory") if payloads else None,
        worker_id="w",
        nak_delay_s=0.1,
        oom_nak_delay_s=0.2,
        held=held,
        stats=stats,
        clock=ManualClock(),
    )
    sub = await js.pull_subscribe_bind(durable="lane", stream=STREAM)
    try:
        yield Rig(nc, js, settlement, held, stats, replies, sub)
    finally:
        await nc.close()


def sched() -> ModelScheduler:
    from protocol.batching import BatchLimits

    s = ModelScheduler(spec=MODEL, limits=BatchLimits(max_cost=100, max_requests=4, max_wait_s=0.01))
    s.ready = True
    return s


def ok(d: Delivery) -> bytes:
    return WorkResult.failure(
        d.route, ErrorCode.INVALID_INPUT, "as the worker encoded it", worker_id="w"
    ).to_msgpack()


async def test_a_result_is_published_to_the_reply_inbox_then_acked(nats_server):
    async with rig(nats_server) as r:
        d = await r.delivery()
        await r.settlement.settle(
            sched(), d, ipc.ItemOutcome(d.route.work_item_id, ipc.PUBLISH_AND_ACK, result=ok(d))
        )
        assert d.settled and d not in r.held
        (reply,) = await r.replies_so_far()
        assert reply.subject == d.route.reply_subject and reply.data == WorkCodec.results_message([ok(d)])
        await r.settled()
        assert r.stats["published"] == 1 and r.stats["acked"] == 1


async def test_an_outcome_without_result_and_a_retry_later_are_naked_and_come_back(nats_server):
    async with rig(nats_server) as r:
        for outcome in (
            ipc.ItemOutcome("r.0", ipc.PUBLISH_AND_ACK),
            ipc.ItemOutcome("r.0", ipc.NAK_RETRY, nak_delay_ms=0),
        ):
            d = await r.delivery()
            await r.settlement.settle(sched(), d, outcome)
            assert d.settled and await r.replies_so_far() == []
            (again,) = await r.sub.fetch(1, timeout=10)  # redelivered
            assert again.metadata.num_delivered == 2
            await again.ack()
        assert r.stats["naked"] == 2


async def test_model_not_loaded_naks_and_asks_for_ensure_again(nats_server):
    async with rig(nats_server) as r:
        d, s = await r.delivery(), sched()
        await r.settlement.settle(
            s, d, ipc.ItemOutcome("r.0", ipc.NAK_RETRY, error_code=ErrorCode.MODEL_NOT_LOADED)
        )
        assert not s.ready and r.stats["naked"] == 1


async def test_resource_exhausted_publishes_nothing(nats_server):
    async with rig(nats_server) as r:
        d = await r.delivery()
        outcome = ipc.ItemOutcome("r.0", ipc.NAK_RETRY, error_code=ErrorCode.RESOURCE_EXHAUSTED)
        await r.settlement.settle(sched(), d, outcome)
        assert await r.replies_so_far() == []
        assert r.stats["naked"] == 1 and r.stats["published"] == 0


async def test_an_undecodable_body_is_answered_copied_to_the_dlq_and_terminated(nats_server):
    async with rig(nats_server) as r:
        d = await r.delivery()
        await r.settlement.settle(sched(), d, ipc.ItemOutcome("r.0", ipc.DEAD_LETTER, error="bad body"))
        (reply,) = await r.replies_so_far()
        (answer,) = results_of(reply)
        assert not answer.success and answer.error_code == ErrorCode.INTERNAL_ERROR
        dead = await r.js.get_last_msg(DLQ_STREAM, "sie.dlq.>")
        assert len(WorkCodec.split(dead.data, 1)[1]) == 1  # the message as it came
        assert dead.headers[DLQ_REASON_HEADER] == "bad body"

        async def gone() -> bool:  # TERM takes it out of the work stream
            return (await r.js.stream_info(STREAM)).state.messages == 0

        await wait_until(gone, 10, what="the work stream empty")
        assert r.stats["dead_lettered"] == 1 and r.stats["naked"] == 0


async def test_a_result_over_the_max_payload_is_replaced_by_a_compact_error(nats_server):
    async with rig(nats_server) as r:
        d = await r.delivery()
        huge = b"x" * (r.nc.max_payload + 1)
        await r.settlement.publish_and_ack(d, huge, success=True)
        (reply,) = await r.replies_so_far()
        (answer,) = results_of(reply)
        assert answer.error_code == ErrorCode.INTERNAL_ERROR and "max payload" in (answer.error or "")
        await r.settled()


async def test_a_result_over_the_max_payload_goes_through_the_payload_store(nats_server):
    async with rig(nats_server, payloads=True) as r:
        d = await r.delivery()
        huge = WorkResult(
            d.route.work_item_id, d.route.request_id, 0, True, b"x" * (r.nc.max_payload + 1)
        ).to_msgpack()
        await r.settlement.publish_and_ack(d, huge, success=True)
        (reply,) = await r.replies_so_far()
        (stub,) = results_of(reply)
        assert stub.result_ref == f"result.{d.route.work_item_id}" and stub.result_msgpack is None
        assert await PayloadStore(r.js).get(stub.result_ref) == huge  # the gateway reads it there
        await r.settled()


async def test_results_for_one_gateway_share_a_message(nats_server):
    async with rig(nats_server) as r:
        ds = [await r.delivery(results=True, request_id=f"r{i}") for i in range(3)]
        await r.settlement.publish_together([(d, ok(d), False) for d in ds])
        (reply,) = await r.replies_so_far()
        assert reply.subject == results_subject("router")
        assert [res.work_item_id for res in results_of(reply)] == [d.route.work_item_id for d in ds]
        await r.settled()
        assert r.stats["published"] == 3 and r.stats["acked"] == 3 and not r.held


async def test_a_settled_delivery_is_settled_once(nats_server):
    async with rig(nats_server) as r:
        d = await r.delivery()
        await r.settlement.ack(d)
        await r.settlement.nak(d, 0.1)
        await r.settlement.publish_and_ack(d, ok(d))
        assert r.stats["acked"] == 1 and r.stats["naked"] == 0 and await r.replies_so_far() == []


async def test_a_release_wakes_a_pull_loop_waiting_for_room(nats_server):
    async with rig(nats_server) as r:
        d = await r.delivery()
        room = asyncio.Event()
        r.held.watch("interactive", room)
        await r.settlement.ack(d)
        assert room.is_set()


async def test_a_chunk_is_acked_once_when_its_last_item_is_settled(nats_server):
    async with rig(nats_server) as r:
        ds = await r.chunk(3)
        assert [d.route.item_index for d in ds] == [0, 1, 2]
        assert [unpackb(d.body)["i"] for d in ds] == [0, 1, 2]
        assert [d.route.work_item_id for d in ds] == ["c.0", "c.1", "c.2"]
        await r.settlement.publish_and_ack(ds[0], ok(ds[0]))
        await r.settlement.ack(ds[1], drop=True)
        assert r.stats["acked"] == 0 and r.stats["dropped"] == 0  # the message is still held
        info = await r.js.consumer_info(STREAM, "lane")
        assert info.num_ack_pending == 1
        await r.settlement.publish_and_ack(ds[2], ok(ds[2]))
        await r.settled()
        assert r.stats["acked"] == 1 and r.stats["published"] == 2 and not r.held


async def test_a_chunk_with_an_item_naked_comes_back_whole_after_the_others(nats_server):
    async with rig(nats_server) as r:
        ds = await r.chunk(3)
        await r.settlement.nak(ds[1], 0.3)
        await r.settlement.nak(ds[2], 0.0)
        assert r.stats["naked"] == 0  # the first item is still being worked on
        await r.settlement.publish_and_ack(ds[0], ok(ds[0]))
        assert r.stats["naked"] == 1 and r.stats["acked"] == 0
        (again,) = await r.sub.fetch(1, timeout=10)  # after the longest delay asked, every item again
        assert again.metadata.num_delivered == 2
        assert [rt.item_index for rt in WorkCodec.routes(again.headers)] == [0, 1, 2]
        await again.ack()


async def test_a_chunk_is_progress_acked_once_and_not_after_it_is_settled(nats_server):
    async with rig(nats_server) as r:
        ds = await r.chunk(4)
        assert leases_of(ds) == [ds[0].lease]
        await r.settlement.progress(ds[0].lease)
        assert r.stats["progress"] == 1 and ds[0].lease.last_progress == r.settlement.clock.now()
        for d in ds:
            await r.settlement.publish_and_ack(d, ok(d))
        assert leases_of(ds) == []
        await r.settlement.progress(ds[0].lease)
        assert r.stats["progress"] == 1


async def test_a_chunk_with_an_undecodable_item_is_dead_lettered_after_the_others(nats_server):
    async with rig(nats_server) as r:
        ds = await r.chunk(2)
        await r.settlement.settle(sched(), ds[0], ipc.ItemOutcome("c.0", ipc.DEAD_LETTER, error="bad body"))
        assert r.stats["dead_lettered"] == 0
        await r.settlement.publish_and_ack(ds[1], ok(ds[1]))
        assert r.stats["dead_lettered"] == 1 and r.stats["acked"] == 0
        dead = await r.js.get_last_msg(DLQ_STREAM, "sie.dlq.>")
        assert dead.headers[DLQ_REASON_HEADER] == "bad body"
        assert len(WorkCodec.split(dead.data, 2)[1]) == 2  # the whole message
        replies = await r.replies_so_far()
        assert sorted(res.item_index for m in replies for res in results_of(m)) == [0, 1]
