"""Done-when of issue 5 (sidecar half): a worker killed mid-batch and a NATS restart lose no work."""

from __future__ import annotations

import asyncio

from nats.js.api import StreamConfig

from protocol.streams import stream_config
from tests.integration.sidecar.support import (
    Gateway,
    WorkerProcess,
    connect,
    model_yaml,
    settled_consumer,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)
from tests.support.polling import wait_until

MODEL = "test/fake-embed"


async def test_worker_killed_mid_batch_items_are_redelivered_and_answered(nats_server, worker_dirs):
    models, bundles = worker_dirs
    (models / "fake.yaml").write_text(model_yaml(MODEL, batch_delay_ms=2500))
    sock = socket_path()
    worker = WorkerProcess(sock, models, bundles).start()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, nak_delay_s=1.0))
    try:
        items = [gw.item("req-kill", i, model_id=MODEL, text=f"k {i}", total=4) for i in range(4)]
        for it in items:
            await gw.publish(it)
        # wait until a batch is inside the worker, then kill the worker process
        await wait_until(lambda: lane.inflight_batches > 0, 60)
        await asyncio.sleep(0.5)
        worker.kill()
        await wait_until(lambda: lane.stats["naked"] >= 1, 10)
        assert not gw.results  # nothing was answered by the dead worker
        # the pod restarts its worker; the NAKed items come back and are served
        worker = WorkerProcess(sock, models, bundles).start()
        got = await gw.wait_for([it.work_item_id for it in items], timeout=120)
        for it in items:
            assert len(got[it.work_item_id]) == 1 and got[it.work_item_id][0].success
        await settled_consumer(lane.js, lane.stream, lane.durable)  # nothing left unacked
    finally:
        await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()


async def test_nats_restart_keeps_queued_work_in_file_storage(nats_server, worker_dirs):
    models, bundles = worker_dirs
    (models / "fake.yaml").write_text(model_yaml(MODEL))
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    # the gateway creates the stream with the shared settings (file storage by default)
    await gw.js.add_stream(StreamConfig(**stream_config("default")))
    queued = [gw.item("req-queued", i, model_id=MODEL, text=f"q {i}", total=5) for i in range(5)]
    for it in queued:
        await gw.publish(it)

    nats_server.restart()  # nothing consumed yet: the work must survive on disk
    worker = WorkerProcess(sock, models, bundles).start()
    lane = nc = client = None
    try:
        await wait_until(lambda: gw_nc.is_connected, 30)
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        got = await gw.wait_for([it.work_item_id for it in queued], timeout=120)
        assert all(r[0].success for r in got.values())

        # a restart while the sidecar runs: it reconnects and keeps consuming the same durable
        nats_server.restart()
        await wait_until(lambda: gw_nc.is_connected and nc.is_connected, 30)
        after = [gw.item("req-after", i, model_id=MODEL, text=f"a {i}", total=3) for i in range(3)]
        for it in after:
            await gw.publish(it)
        got = await gw.wait_for([it.work_item_id for it in after], timeout=120)
        assert all(r[0].success for r in got.values())
    finally:
        if lane is not None:
            await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()


async def test_memory_stream_is_recreated_after_a_nats_restart(nats_server, worker_dirs):
    """With memory storage a restart loses the stream; the sidecar re-ensures stream and durable."""
    models, bundles = worker_dirs
    (models / "fake.yaml").write_text(model_yaml(MODEL))
    sock = socket_path()
    worker = WorkerProcess(sock, models, bundles).start()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, stream_storage="memory"))
    try:
        await _one_through(gw, "req-mem-1", "before")
        nats_server.restart()
        await wait_until(lambda: gw_nc.is_connected and nc.is_connected, 30)
        # the gateway side would re-create the stream on publish; here the sidecar must do it
        await wait_until(lambda: lane.stats.get("reensured", 0) >= 1, 60)
        await _one_through(gw, "req-mem-2", "after")
    finally:
        await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()


async def test_after_a_nats_restart_the_sidecar_pulls_again_at_once(nats_server, worker_dirs):
    """A server killed and started again has forgotten the sidecar's open pull request without a
    word; the sidecar opens a new one when it reconnects, not when the old one would have expired
    (here a minute)."""
    models, bundles = worker_dirs
    (models / "fake.yaml").write_text(model_yaml(MODEL))
    sock = socket_path()
    worker = WorkerProcess(sock, models, bundles).start()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    await gw.js.add_stream(StreamConfig(**stream_config("default")))
    lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, nats_fetch_timeout_s=60.0))
    try:
        await _one_through(gw, "req-pull-1", "before")
        nats_server.restart(kill=True)
        await wait_until(lambda: gw_nc.is_connected and nc.is_connected, 30)
        await _one_through(gw, "req-pull-2", "after", timeout=20)
    finally:
        await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()


async def _one_through(gw, request_id: str, text: str, timeout: float = 60.0) -> None:
    """Publish one item and wait for its successful result."""
    item = gw.item(request_id, 0, model_id=MODEL, text=text)
    await gw.publish(item)
    got = await gw.wait_for([item.work_item_id], timeout=timeout)
    assert got[item.work_item_id][0].success
