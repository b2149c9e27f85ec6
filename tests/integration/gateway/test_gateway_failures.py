"""Failure handling: a worker dying mid-batch, nats-server restarting, under real NATS."""

from __future__ import annotations

import asyncio

from tests.integration.gateway.conftest import DENSE
from tests.integration.gateway.fake_worker import FakeWorker, fake_vector
from tests.integration.gateway.test_gateway_flow import post, wait_workers


async def test_worker_killed_mid_batch_items_are_redelivered_and_answered(nats_server, start_gateway):
    h = await start_gateway(gateway_request_timeout_s=20.0)
    got_some = asyncio.Event()

    async def dies(item, worker):
        got_some.set()
        return None  # takes the item, never answers or acks: then the process dies

    dying = await FakeWorker(nats_server.url, "dying", handler=dies, ack_wait_s=1.5).start()
    await wait_workers(h)
    items = [{"id": str(i), "text": f"text {i}"} for i in range(6)]
    req = asyncio.create_task(post(h, f"/v1/encode/{DENSE}", {"items": items}))
    await asyncio.wait_for(got_some.wait(), 5)
    await dying.kill()
    survivor = await FakeWorker(nats_server.url, "survivor", ack_wait_s=1.5).start()
    try:
        status, _, body = await req
        assert status == 200, body
        assert [it["id"] for it in body["items"]] == [str(i) for i in range(6)]
        for it, src in zip(body["items"], items, strict=True):
            assert list(it["dense"]["values"]) == list(fake_vector(src["text"]))
        assert survivor.seen  # the survivor answered what the dead worker held
    finally:
        await survivor.stop()


async def test_nats_restart_keeps_queued_work_and_gateway_recovers(nats_server, start_gateway):
    h = await start_gateway(gateway_request_timeout_s=25.0)
    # registered but not consuming yet: the work waits in the (file-storage) stream
    idle = await FakeWorker(nats_server.url, "w1", consume=False).start()
    await wait_workers(h)
    req = asyncio.create_task(post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "kept"}, {"text": "also"}]}))
    await asyncio.sleep(0.5)
    await idle.kill()
    nats_server.restart()
    for _ in range(100):
        if h.nc.is_connected:
            break
        await asyncio.sleep(0.1)
    assert h.nc.is_connected
    worker = await FakeWorker(nats_server.url, "w1").start()
    try:
        status, _, body = await req
        assert status == 200, body
        assert [list(it["dense"]["values"]) for it in body["items"]] == [
            list(fake_vector("kept")),
            list(fake_vector("also")),
        ]
        # and new requests flow normally after the restart
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "after"}]})
        assert status == 200, body
    finally:
        await worker.stop()


async def test_nats_down_gives_retryable_errors(nats_server, start_gateway):
    h = await start_gateway(gateway_request_timeout_s=3.0)
    w = await FakeWorker(nats_server.url, "w1").start()
    await wait_workers(h)
    await w.kill()
    nats_server.stop()
    try:
        for _ in range(50):
            if not h.nc.is_connected:
                break
            await asyncio.sleep(0.1)
        status, headers, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]})
        assert status in (503, 504), body
        assert "Retry-After" in headers
        async with h.session.get(h.url("/readyz")) as r:
            assert r.status == 503
    finally:
        nats_server.start()
