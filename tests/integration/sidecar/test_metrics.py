"""The worker pod's metrics port: the sidecar's own metrics and the worker's (over IPC) on one scrape."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar.metrics import start_metrics_server
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
from tests.support.nats_server import free_port

MODEL = "test/fake-embed"


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(found: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


async def scrape(port: int) -> dict[str, list]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        return samples(await resp.text())


async def test_pod_metrics_cover_sidecar_lane_and_worker(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    port = free_port()
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        runner = await start_metrics_server(lane, "127.0.0.1", port)
        try:
            items = [gw.item("req-m", i, model_id=MODEL, text=f"item {i}", total=5) for i in range(5)]
            for it in items:
                await gw.publish(it)
            await gw.wait_for([it.work_item_id for it in items])
            found = await scrape(port)
            # the sidecar's own
            assert value(found, "sie_sidecar_deliveries_total", event="published") == 5
            assert value(found, "sie_sidecar_queue_wait_seconds_count") == 5
            assert value(found, "sie_sidecar_batch_size_sum", model=MODEL) == 5
            assert value(found, "sie_sidecar_run_batch_seconds_count", model=MODEL) >= 1
            assert value(found, "sie_sidecar_worker_ready") == 1
            # the lane durable's depth, read from JetStream, labelled with the lane
            lane_labels = {"pool": "default", "machine_profile": "cpu", "bundle": "default"}
            assert [s.labels for s in found["sie_sidecar_lane_pending"]] == [lane_labels]
            assert value(found, "sie_sidecar_lane_ack_pending", **lane_labels) == 0
            # the worker's, fetched over IPC
            assert value(found, "sie_sidecar_worker_metrics_up") == 1
            assert value(found, "sie_worker_loaded_models") == 1
            assert value(found, "sie_worker_batch_size_sum", model=MODEL) == 5
            assert value(found, "sie_worker_stage_seconds_count", model=MODEL, stage="inference") >= 1
            assert value(found, "sie_worker_model_load_seconds_count", model=MODEL) == 1
        finally:
            await stop_lane(lane, nc, client)
    # the worker is gone: the sidecar still answers, and says the worker's part is missing
    found = await scrape(port)
    await runner.cleanup()
    await gw_nc.close()
    assert value(found, "sie_sidecar_worker_metrics_up") == 0
    assert "sie_worker_loaded_models" not in found
    assert value(found, "sie_sidecar_deliveries_total", event="published") == 5


async def test_a_redelivered_item_is_counted(nats_server):
    """An item NAKed once (here by another client of the lane durable) counts as a redelivery when
    the sidecar gets it again."""
    from sidecar.streams import ensure_lane_consumer, ensure_stream

    sock = socket_path()
    settings = sidecar_settings(nats_server.url, sock)
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    js = gw_nc.jetstream()
    stream = await ensure_stream(js, settings)
    durable = await ensure_lane_consumer(js, stream, settings)
    item = gw.item("req-r", 0, model_id=MODEL, text="again", total=1)
    await gw.publish(item)
    other = await js.pull_subscribe_bind(durable=durable, stream=stream)
    (msg,) = await other.fetch(1, timeout=5)
    await msg.nak()
    await other.unsubscribe()
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(settings)
        try:
            (res,) = (await gw.wait_for([item.work_item_id]))[item.work_item_id]
            assert res.success
            registry = lane.metrics.registry
            assert registry.get_sample_value("sie_sidecar_redeliveries_total") == 1
            assert registry.get_sample_value("sie_sidecar_queue_wait_seconds_count") == 1
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()
