"""Priority classes in the sidecar (issue 17): interactive work overtakes a bulk backlog, and bulk
work still progresses under an interactive flood. Real nats-server, real worker IPC server (fake
adapter with slow forward passes), the gateway's subjects for both classes.

Order, not time, is asserted: results are recorded in the order they arrive at the inbox.
"""

from __future__ import annotations

import asyncio

from protocol.subjects import BULK, lane_durable, work_subject
from protocol.work_codec import WorkCodec
from tests.integration.sidecar.support import (
    Gateway,
    InProcessWorker,
    connect,
    model_yaml,
    settled_consumer,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)
from tests.support.polling import wait_until

MODEL = "test/fake-priority"


class OrderedGateway(Gateway):
    """Also keeps the arrival order of the results."""

    def __init__(self, nc) -> None:
        super().__init__(nc)
        self.order: list[str] = []

    async def _on_result(self, msg) -> None:
        await super()._on_result(msg)
        self.order += [res.request_id for res in WorkCodec.results(msg.data)]

    async def publish_bulk(self, item) -> None:
        subject = work_subject("default", "cpu", "default", item.job.model_id, BULK)
        msg = self.message(item)
        await self.js.publish(subject, msg.payload, headers=msg.headers)


async def test_an_interactive_item_overtakes_a_bulk_backlog(nats_server):
    sock = socket_path()
    gw = await OrderedGateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=40)):
        settings = sidecar_settings(nats_server.url, sock, batcher_max_batch_requests=4)
        lane, nc, client = await start_lane(settings)
        try:
            n = 120
            bulk = [gw.item("bulk", i, model_id=MODEL, text=f"bulk {i}", total=n) for i in range(n)]
            for it in bulk:
                await gw.publish_bulk(it)
            await wait_until(lambda: len(gw.order) >= 4)  # the backlog is being worked through
            urgent = gw.item("urgent", 0, model_id=MODEL, text="a search query")
            await gw.publish(urgent)
            await gw.wait_for([urgent.work_item_id] + [it.work_item_id for it in bulk])
            position = gw.order.index("urgent")
            # it waited for at most the bulk batch on the worker and the one cut with it, not the
            # ~100 bulk items still queued
            assert position <= 4 + 3 * settings.batcher_max_batch_requests, gw.order
            assert gw.order.count("bulk") == n  # and the backlog was finished
            await settled_consumer(lane.js, lane.stream, lane_durable("default", "cpu", "default", BULK))
        finally:
            await stop_lane(lane, nc, client)


async def test_bulk_progresses_under_an_interactive_flood(nats_server):
    sock = socket_path()
    gw = await OrderedGateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=20)):
        # a small held budget: without the bulk share the interactive flood would hold all of it
        settings = sidecar_settings(
            nats_server.url,
            sock,
            batcher_max_batch_requests=4,
            max_held_messages=16,
            bulk_max_wait_ms=100,
            max_concurrent_batches=1,
        )
        lane, nc, client = await start_lane(settings)
        try:
            flood = [gw.item("flood", i, model_id=MODEL, text=f"query {i}", total=200) for i in range(200)]
            for it in flood:
                await gw.publish(it)
            await wait_until(lambda: len(gw.order) >= 4)
            slow = [gw.item("bulk", i, model_id=MODEL, text=f"doc {i}", total=8) for i in range(8)]
            for it in slow:
                await gw.publish_bulk(it)
            await gw.wait_for([it.work_item_id for it in flood + slow], timeout=120)
            last_bulk = max(i for i, rid in enumerate(gw.order) if rid == "bulk")
            last_flood = max(i for i, rid in enumerate(gw.order) if rid == "flood")
            # the bulk items were not left until the interactive flood had drained
            assert last_bulk < last_flood - 40, (last_bulk, last_flood)
        finally:
            await stop_lane(lane, nc, client)


async def test_bulk_batches_shrink_while_interactive_work_arrives(nats_server):
    """Alone, bulk runs in full-size batches; while interactive work of the model arrives, in the
    mixed size, so the next interactive item waits behind a short bulk batch only."""
    sock = socket_path()
    gw = await OrderedGateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=30)) as worker:
        sizes: list[tuple[str, int]] = []
        classes: list[str] = []  # the class each batch reached the worker as
        run = worker.runtime.run_work_items

        async def recording(items, *, priority):
            sizes.append((items[0].request_id, len(items)))
            classes.append(priority)
            return await run(items, priority=priority)

        worker.runtime.run_work_items = recording  # type: ignore[method-assign]
        settings = sidecar_settings(nats_server.url, sock, batcher_max_batch_requests=16,
                                    bulk_max_batch_requests=8, bulk_mixed_batch_requests=2)  # fmt: skip
        lane, nc, client = await start_lane(settings)
        try:
            alone = [gw.item("alone", i, model_id=MODEL, text=f"doc {i}", total=40) for i in range(40)]
            for it in alone:
                await gw.publish_bulk(it)
            await gw.wait_for([it.work_item_id for it in alone], timeout=60)
            assert max(n for rid, n in sizes if rid == "alone") == 8
            assert set(classes) == {"bulk"}
            sizes.clear()

            async def query(i: int) -> None:
                q = gw.item(f"query-{i}", 0, model_id=MODEL, text="a search query")
                await gw.publish(q)
                await gw.wait_for([q.work_item_id], timeout=30)

            # interactive work arrives first (answered before the backlog is published, so no bulk
            # batch can be cut before the sidecar has seen it) and goes on until the backlog is done:
            # however fast or slow the host, every bulk batch is cut while interactive work arrives
            await query(0)
            mixed = [gw.item("mixed", i, model_id=MODEL, text=f"doc {i}", total=40) for i in range(40)]
            for it in mixed:
                await gw.publish_bulk(it)
            backlog = asyncio.create_task(gw.wait_for([it.work_item_id for it in mixed], timeout=60))
            queries = 1
            while not backlog.done():
                await query(queries)
                queries += 1
            await backlog
            bulk = [n for rid, n in sizes if rid == "mixed"]
            assert queries > 2 and len(bulk) >= 20 and max(bulk) <= 2, sizes
        finally:
            await stop_lane(lane, nc, client)
