"""Dead letters (issue 12): a work item that ran out of deliveries is forwarded to DEAD_LETTERS,
its request item fails at once, and it is deleted from the work stream, so that the QUEUE_FULL
admission (which counts the stream's messages) no longer counts it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from protocol.subjects import DLQ_STREAM, pool_stream_name
from tests.integration.gateway.conftest import DENSE
from tests.integration.gateway.fake_worker import FakeWorker
from tests.integration.gateway.test_gateway_flow import post, wait_workers


async def never_answers(item, worker):
    return None  # takes the item and never acks it: every delivery times out


@contextlib.asynccontextmanager
async def stuck_worker(nats_server, h) -> AsyncIterator[FakeWorker]:
    """A worker the gateway sees that takes each item and never answers, with two deliveries of
    half a second each: whatever it is sent is dead-lettered within about a second."""
    stuck = await FakeWorker(
        nats_server.url, "stuck", handler=never_answers, ack_wait_s=0.5, max_deliver=2
    ).start()
    try:
        await wait_workers(h)
        yield stuck
    finally:
        await stuck.kill()


async def test_a_dead_item_is_forwarded_removed_from_the_stream_and_not_counted(nats_server, start_gateway):
    h = await start_gateway(gateway_max_stream_pending=1, gateway_request_timeout_s=30.0)
    js = h.nc.jetstream()
    async with stuck_worker(nats_server, h) as stuck:
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "doomed"}]})
        assert status >= 500 and "dead-lettered" in str(body), body  # failed at once, not at the deadline
        assert len(stuck.seen) == 2
        work = pool_stream_name("default")
        for _ in range(100):  # generous: only guards against a hang
            if (await js.stream_info(work)).state.messages == 0:
                break
            await asyncio.sleep(0.05)
        assert (await js.stream_info(work)).state.messages == 0
        assert (await js.stream_info(DLQ_STREAM)).state.messages == 1
    # with the dead message gone the one-slot queue admits a new request (no QUEUE_FULL)
    await asyncio.sleep(0.3)  # past the gateway's cached stream size
    good = await FakeWorker(nats_server.url, "good").start()
    try:
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "admitted"}]})
        assert status == 200, body
    finally:
        await good.stop()


async def test_a_dead_chunk_fails_every_item_it_carried_at_once(nats_server, start_gateway):
    h = await start_gateway(gateway_request_timeout_s=30.0)
    js = h.nc.jetstream()
    async with stuck_worker(nats_server, h) as stuck:
        items = [{"text": f"doomed {i}"} for i in range(3)]
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": items})
        assert status >= 500 and "dead-lettered" in str(body), body  # failed at once, not at the deadline
        assert len(stuck.seen) == 6  # one message of three items, delivered twice
        assert {it.item_index for it in stuck.seen} == {0, 1, 2}
        for _ in range(100):  # generous: only guards against a hang
            if (await js.stream_info(DLQ_STREAM)).state.messages == 1:
                break
            await asyncio.sleep(0.05)
        assert (await js.stream_info(DLQ_STREAM)).state.messages == 1
