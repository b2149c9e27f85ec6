"""The sidecar keeps no more interactive batches of a model on the worker than the worker takes at
once (its forwards in flight, told in EnsureModelReady: 1 on CPU). What arrives while a batch runs
waits in the sidecar and goes as one batch when it ends, as ``sie serve`` batches it, instead of
queueing on the worker as a small batch cut every ``batcher_max_batch_wait_ms``."""

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
    wait_until,
)

MODEL = "test/fake-depth"


async def test_items_arriving_during_a_forward_join_one_next_batch(nats_server):
    sock = socket_path()
    gw = await Gateway(await connect(nats_server.url)).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=2000)) as worker:
        sizes: list[int] = []
        run = worker.runtime.run_work_items

        async def recording(items):
            sizes.append(len(items))
            return await run(items)

        worker.runtime.run_work_items = recording  # type: ignore[method-assign]
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=10))
        try:
            first = gw.item("first", 0, model_id=MODEL, text="the first one")
            await gw.publish(first)
            await wait_until(lambda: sizes == [1], 30)  # its forward runs (2 s)
            later = []
            for i in range(8):  # spread over several batch-wait periods, all within that forward
                it = gw.item(f"later-{i}", 0, model_id=MODEL, text=f"later {i}")
                later.append(it)
                await gw.publish(it)
                await asyncio.sleep(0.05)
            assert sizes == [1], "the first forward ended before the others were published"
            got = await gw.wait_for([first.work_item_id] + [it.work_item_id for it in later], timeout=60)
            assert all(r[0].success for r in got.values())
            assert sizes == [1, 8]  # one batch after the first, not several small ones
        finally:
            await stop_lane(lane, nc, client)
