"""The sidecar keeps no more interactive batches of a model on the worker than the worker takes at
once (its forwards in flight, told in EnsureModelReady: one per concurrent forward on CPU). What
arrives while a batch runs waits in the sidecar and goes as one batch when it ends, as ``sie serve``
batches it, instead of queueing on the worker as a small batch cut every
``batcher_max_batch_wait_ms``.

A batch on the worker here ends when the test opens its gate (:class:`Batches`), not after a
sleep, so what counts as "during a forward" is decided by the test. The same rules are stepped on a
manual clock in tests/unit/sidecar/test_scheduling.py."""

from __future__ import annotations

import asyncio

from tests.integration.sidecar.support import (
    Gateway,
    InProcessWorker,
    connect,
    model_yaml,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)
from tests.support.polling import wait_until

MODEL = "test/fake-depth"


async def test_items_arriving_during_a_forward_join_one_next_batch(nats_server):
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL)) as worker:
        batches = Batches(worker)
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10)
        )
        try:
            first = gw.item("first", 0, model_id=MODEL, text="the first one")
            await gw.publish(first)
            await wait_until(lambda: batches.sizes == [1], 30)  # its forward runs until released
            later = await _publish_spread(gw, 8)  # over several batch-wait periods
            await wait_until(lambda: lane.queue_depth() == 8, 30, what="all eight queued")
            assert batches.sizes == [1]
            batches.release_all()
            got = await gw.wait_for([first.work_item_id] + [it.work_item_id for it in later], timeout=60)
            assert all(r[0].success for r in got.values())
            assert batches.sizes == [1, 8]  # one batch after the first, not several small ones
        finally:
            batches.release_all()
            await stop_lane(lane, nc, client)


async def test_a_worker_with_two_forwards_gets_an_item_at_once_while_one_is_busy(nats_server):
    """SIE_FORWARD_THREADS=2 (told in EnsureModelReady): while one forward runs a batch the other is
    idle, so the next item goes at once instead of waiting for the running batch; what arrives
    while both run goes as one batch when one frees."""
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL), forward_threads=2) as worker:
        batches = Batches(worker)
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10)
        )
        try:
            items = [gw.item("first", 0, model_id=MODEL, text="the first one")]
            await gw.publish(items[0])
            await wait_until(lambda: batches.sizes == [1], 30)
            items.append(gw.item("second", 0, model_id=MODEL, text="the second one"))
            await gw.publish(items[1])
            await wait_until(lambda: batches.sizes == [1, 1], 10)  # on the idle forward, beside the first
            items += await _publish_spread(gw, 6)
            await wait_until(lambda: lane.queue_depth() == 6, 30, what="all six queued")
            assert batches.sizes == [1, 1]
            batches.release(0)  # one forward frees: the six go to it as one batch
            await wait_until(lambda: batches.sizes == [1, 1, 6], 30)
            batches.release_all()
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert batches.sizes == [1, 1, 6]
        finally:
            batches.release_all()
            await stop_lane(lane, nc, client)


async def test_items_pending_while_two_forwards_are_idle_are_shared_between_them(nats_server):
    """With both forwards idle, what is pending goes as an equal share to each
    (``protocol.ipc.forward_share``): six items that queued while the model loaded run as two batches
    of three, not one of six beside an idle forward."""
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    yaml = model_yaml(MODEL, load_delay_s=2.0)
    async with InProcessWorker(sock, yaml, forward_threads=2) as worker:
        batches = Batches(worker, gated=False)
        settings = sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10)
        lane, nc, client = await start_lane(settings)
        try:
            items = [gw.item(f"queued-{i}", 0, model_id=MODEL, text=f"queued {i}") for i in range(6)]
            for it in items:
                await gw.publish(it)
            await wait_until(lambda: lane.queue_depth() == 6, 30, what="all six queued")
            assert batches.sizes == []  # still loading (2 s)
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert batches.sizes == [3, 3]
        finally:
            await stop_lane(lane, nc, client)


async def test_an_idle_worker_gets_a_request_whole_when_its_items_arrive_apart(nats_server):
    """A request's items reach the sidecar one message at a time. With the worker idle, the first
    would go alone and the rest wait a whole forward; the sidecar waits (``batcher_gather_ms``)
    for the rest of the request, which the gateway counted in each item's routing header, and sends
    it as one batch."""
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL)) as worker:
        batches = Batches(worker)
        settings = sidecar_settings(
            nats_server.url, sock, batcher_max_batch_wait_ms=30_000, batcher_gather_ms=30_000
        )
        lane, nc, client = await start_lane(settings)
        try:
            await _warm(gw, batches)
            items = [gw.item("req", i, model_id=MODEL, text=f"part {i}", total=3) for i in range(3)]
            await gw.publish(items[0], request_items=3)
            await wait_until(lambda: lane.queue_depth() == 1, 30, what="the first item queued")
            await asyncio.sleep(0.1)  # the rest of the request comes later
            assert batches.sizes == []
            for it in items[1:]:
                await gw.publish(it, request_items=3)
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert batches.sizes == [3]
        finally:
            await stop_lane(lane, nc, client)


async def test_without_the_gather_wait_a_request_arriving_apart_is_cut_in_two(nats_server):
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL)) as worker:
        batches = Batches(worker)
        settings = sidecar_settings(
            nats_server.url, sock, batcher_max_batch_wait_ms=1000, batcher_gather_ms=0
        )
        lane, nc, client = await start_lane(settings)
        try:
            await _warm(gw, batches)
            batches.gated = True
            items = [gw.item("req", i, model_id=MODEL, text=f"part {i}", total=3) for i in range(3)]
            await gw.publish(items[0], request_items=3)
            await wait_until(lambda: batches.sizes == [1], 30, what="the first item alone")
            for it in items[1:]:
                await gw.publish(it, request_items=3)
            await wait_until(lambda: lane.queue_depth() == 2, 30, what="the rest queued")
            batches.release_all()
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert all(r[0].success for r in got.values())
            assert batches.sizes == [1, 2]
        finally:
            batches.release_all()
            await stop_lane(lane, nc, client)


class Batches:
    """Every RunBatch the worker runs from now on: its size, in order; while ``gated``, each waits
    on the worker until the test releases it."""

    def __init__(self, worker: InProcessWorker, *, gated: bool = True) -> None:
        self.sizes: list[int] = []
        self.gated = gated
        self._gates: list[asyncio.Event] = []
        self._all = False
        run = worker.runtime.run_work_items

        async def recording(items, **kw):
            self.sizes.append(len(items))
            gate = asyncio.Event()
            self._gates.append(gate)
            if self.gated and not self._all:
                await gate.wait()
            return await run(items, **kw)

        worker.runtime.run_work_items = recording  # type: ignore[method-assign]

    def release(self, index: int) -> None:
        self._gates[index].set()

    def release_all(self) -> None:
        """Open every gate, now and from now on."""
        self._all = True
        for gate in self._gates:
            gate.set()


async def _warm(gw: Gateway, batches: Batches) -> None:
    """Load the model with one item, then forget that batch; later batches are gated again."""
    batches.gated = False
    warm = gw.item("warm", 0, model_id=MODEL, text="load the model first")
    await gw.publish(warm)
    await gw.wait_for([warm.work_item_id], timeout=60)
    batches.sizes.clear()
    batches._gates.clear()


async def _publish_spread(gw: Gateway, n: int) -> list:
    """Publish ``n`` items 50 ms apart (over several batch-wait periods); returns them."""
    items = []
    for i in range(n):
        it = gw.item(f"later-{i}", 0, model_id=MODEL, text=f"later {i}")
        items.append(it)
        await gw.publish(it)
        await asyncio.sleep(0.05)
    return items
