"""The sidecar keeps no more interactive batches of a model on the worker than the worker takes at
once (its forwards in flight, told in EnsureModelReady: one per forward lane on CPU). What arrives
while a batch runs waits in the sidecar and goes as one batch when it ends, as ``sie serve``
batches it, instead of queueing on the worker as a small batch cut every
``batcher_max_batch_wait_ms``."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.sidecar.support import (
    Gateway,
    InProcessWorker,
    connect,
    model_yaml,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
    wait_until,
)

MODEL = "test/fake-depth"


async def test_items_arriving_during_a_forward_join_one_next_batch(nats_server):
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=2000)) as worker:
        sizes = _batch_sizes(worker)
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10)
        )
        try:
            first = gw.item("first", 0, model_id=MODEL, text="the first one")
            await gw.publish(first)
            await wait_until(lambda: sizes == [1], 30)  # its forward runs (2 s)
            later = await _publish_spread(gw, 8)  # all within that forward
            assert sizes == [1], "the first forward ended before the others were published"
            got = await gw.wait_for([first.work_item_id] + [it.work_item_id for it in later], timeout=60)
            assert all(r[0].success for r in got.values())
            assert sizes == [1, 8]  # one batch after the first, not several small ones
        finally:
            await stop_lane(lane, nc, client)


async def test_a_worker_with_two_lanes_gets_an_item_at_once_while_one_lane_is_busy(nats_server):
    """SIE_FORWARD_THREADS=2 (told in EnsureModelReady): while one lane runs a batch the other is
    idle, so the next item goes at once instead of waiting for the running batch; what arrives
    while both run goes as one batch when a lane frees."""
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=2000), forward_threads=2) as worker:
        sizes = _batch_sizes(worker)
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10)
        )
        try:
            items = [gw.item("first", 0, model_id=MODEL, text="the first one")]
            await gw.publish(items[0])
            await wait_until(lambda: sizes == [1], 30)
            items.append(gw.item("second", 0, model_id=MODEL, text="the second one"))
            await gw.publish(items[1])
            await wait_until(lambda: sizes == [1, 1], 10)  # on the idle lane, beside the first
            items += await _publish_spread(gw, 6)
            assert sizes == [1, 1], "a forward ended before the others were published"
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert sizes == [1, 1, 6]
        finally:
            await stop_lane(lane, nc, client)


async def test_items_pending_while_two_lanes_are_idle_are_shared_between_them(nats_server):
    """With both lanes idle, what is pending goes as an equal share to each lane
    (``protocol.ipc.forward_share``): six items that queued while the model loaded run as two batches
    of three, not one of six beside an idle lane."""
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    yaml = model_yaml(MODEL, load_delay_s=2.0, batch_delay_ms=300)
    async with InProcessWorker(sock, yaml, forward_threads=2) as worker:
        sizes = _batch_sizes(worker)
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10)
        )
        try:
            items = [gw.item(f"queued-{i}", 0, model_id=MODEL, text=f"queued {i}") for i in range(6)]
            for it in items:
                await gw.publish(it)
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert sizes == [3, 3]
        finally:
            await stop_lane(lane, nc, client)


@pytest.mark.parametrize(("gather_ms", "expected"), [(400.0, [3]), (0.0, [1, 2])])
async def test_an_idle_worker_gets_a_request_whole_when_its_items_arrive_apart(
    nats_server, gather_ms, expected
):
    """A request's items reach the sidecar one message at a time. With the worker idle, the first
    would go alone and the rest wait a whole forward; the sidecar waits (``batcher_gather_ms``)
    for the rest of the request, which the gateway counted in each item's routing header, and sends
    it as one batch. Without the wait it is cut in two."""
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=300)) as worker:
        sizes = _batch_sizes(worker)
        settings = sidecar_settings(
            nats_server.url, sock, batcher_max_batch_wait_ms=1000, batcher_gather_ms=gather_ms
        )
        lane, nc, client = await start_lane(settings)
        try:
            warm = gw.item("warm", 0, model_id=MODEL, text="load the model first")
            await gw.publish(warm)
            await gw.wait_for([warm.work_item_id], timeout=60)
            sizes.clear()
            items = [gw.item("req", i, model_id=MODEL, text=f"part {i}", total=3) for i in range(3)]
            await gw.publish(items[0], request_items=3)
            await asyncio.sleep(0.1)  # the rest of the request comes 100 ms later
            for it in items[1:]:
                await gw.publish(it, request_items=3)
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert sizes == expected
        finally:
            await stop_lane(lane, nc, client)


def _batch_sizes(worker: InProcessWorker) -> list[int]:
    """The size of every RunBatch the worker runs from now on, in order."""
    sizes: list[int] = []
    run = worker.runtime.run_work_items

    async def recording(items):
        sizes.append(len(items))
        return await run(items)

    worker.runtime.run_work_items = recording  # type: ignore[method-assign]
    return sizes


async def _publish_spread(gw: Gateway, n: int) -> list:
    """Publish ``n`` items 50 ms apart (over several batch-wait periods); returns them."""
    items = []
    for i in range(n):
        it = gw.item(f"later-{i}", 0, model_id=MODEL, text=f"later {i}")
        items.append(it)
        await gw.publish(it)
        await asyncio.sleep(0.05)
    return items
