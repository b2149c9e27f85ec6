"""Recovery by events, not timers (issue 12): when the worker's IPC socket closes the sidecar gives
its items back at once, says not-ready in a heartbeat at once, and resumes as soon as the worker
answers Ping again. Timers are set long here (NAK delay and ack wait 120 s, heartbeat period 60 s),
so only the event path can pass within the waits."""

from __future__ import annotations

import json

from protocol.subjects import health_subject
from tests.integration.sidecar.support import (
    Gateway,
    WorkerProcess,
    connect,
    model_yaml,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)
from tests.support.polling import wait_until

MODEL = "test/fake-embed"


async def test_a_lost_worker_returns_items_at_once_and_the_lane_resumes_on_ping(nats_server, worker_dirs):
    models, bundles = worker_dirs
    (models / "fake.yaml").write_text(model_yaml(MODEL, batch_delay_ms=2500))
    sock = socket_path()
    worker = WorkerProcess(sock, models, bundles).start()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    settings = sidecar_settings(
        nats_server.url, sock, nak_delay_s=120.0, ack_wait_s=120.0, health_publish_interval_ms=60000
    )
    beats: list[dict] = []

    async def on_beat(msg) -> None:
        beats.append(json.loads(msg.data))

    await gw_nc.subscribe(health_subject(settings.worker_id), cb=on_beat)
    lane, nc, client = await start_lane(settings)
    try:
        await wait_until(lambda: any(b["ready"] for b in beats), 30)
        items = [gw.item("req-loss", i, model_id=MODEL, text=f"l {i}", total=6) for i in range(6)]
        for it in items:
            await gw.publish(it)
        await wait_until(lambda: lane.inflight_batches > 0, 60)
        seen = len(beats)
        worker.kill()
        # given back at once: nothing held, nothing waiting for the 60 s ack wait
        await wait_until(lambda: not lane.held and lane.stats["naked"] >= 6, 10)  # generous: no hang
        # not ready, said at once (the periodic heartbeat is a minute away)
        await wait_until(lambda: any(not b["ready"] for b in beats[seen:]), 10)
        assert not lane.ready
        assert not gw.results  # the dead worker answered nothing
        seen = len(beats)
        worker = WorkerProcess(sock, models, bundles).start()
        await wait_until(lambda: any(b["ready"] for b in beats[seen:]), 30)
        got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
        for it in items:
            assert len(got[it.work_item_id]) == 1 and got[it.work_item_id][0].success
    finally:
        await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()


async def test_a_batch_longer_than_the_ack_wait_is_kept_by_progress_acks(nats_server, worker_dirs):
    """The short ack wait only recovers dead sidecars' items: a live one's batch keeps its lease."""
    models, bundles = worker_dirs
    (models / "fake.yaml").write_text(model_yaml(MODEL, batch_delay_ms=4000))
    sock = socket_path()
    worker = WorkerProcess(sock, models, bundles).start()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, ack_wait_s=1.5))
    try:
        items = [gw.item("req-long", i, model_id=MODEL, text=f"long {i}", total=3) for i in range(3)]
        for it in items:
            await gw.publish(it)
        got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
        for it in items:
            assert len(got[it.work_item_id]) == 1 and got[it.work_item_id][0].success
        # 4 s batches, 1.5 s ack wait: nothing was delivered twice
        assert lane.stats["received"] == 3 and lane.stats["progress"] >= 2, lane.stats
    finally:
        await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()
