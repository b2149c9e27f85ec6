"""Poison messages (issue 12): an undecodable work message is written to the DLQ with the reason and
terminated at once (no NAK cycle through max_deliver), which also removes it from the work stream."""

from __future__ import annotations

from nats.js.api import StreamConfig

from protocol.streams import dlq_stream_config
from protocol.subjects import (
    DLQ_REASON_HEADER,
    DLQ_STREAM,
    DLQ_SUBJECT_HEADER,
    normalize_id,
    pool_stream_name,
)
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

MODEL = "test/fake-embed"
POISON = b"\xc1 not msgpack at all"


async def _work_stream_empties(js) -> None:
    """Until the work stream holds nothing (a TERM is applied by the server shortly after the
    sidecar sends it)."""

    async def empty() -> bool:
        return (await js.stream_info(pool_stream_name("default"))).state.messages == 0

    await wait_until(empty, 10, what="the work stream empty")


async def test_an_undecodable_message_is_dead_lettered_at_once_and_leaves_the_work_stream(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    js = gw_nc.jetstream()
    await js.add_stream(StreamConfig(**dlq_stream_config(storage="memory")))
    gw = await Gateway(gw_nc).start()
    arrivals: list = []

    async def on_dead(msg) -> None:
        arrivals.append(msg)

    await gw_nc.subscribe("sie.dlq.>", cb=on_dead)
    async with InProcessWorker(sock, model_yaml(MODEL)):
        # nak_delay_s and ack_wait long: a NAK or redelivery cycle could not finish within the waits below
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, nak_delay_s=30.0))
        try:
            good = gw.item("req-ok", 0, model_id=MODEL, text="fine")
            await gw.publish(good)
            await gw.wait_for([good.work_item_id])  # the lane is pulling
            await gw.publish_raw(MODEL, POISON)
            await wait_until(lambda: arrivals, 10)  # generous: only guards against a hang
            msg = arrivals[0]
            assert msg.subject == f"sie.dlq.{normalize_id(MODEL)}"
            assert msg.data == POISON
            assert msg.headers[DLQ_REASON_HEADER].startswith("undecodable work item:")
            assert msg.headers[DLQ_SUBJECT_HEADER].endswith(normalize_id(MODEL))
            assert (await js.stream_info(DLQ_STREAM)).state.messages == 1  # kept in DEAD_LETTERS
            # terminated, not NAKed: no longer in the work stream, nothing redelivered
            await wait_until(lambda: lane.stats["dead_lettered"] == 1, 10)
            await _work_stream_empties(js)
            assert lane.stats["naked"] == 0
            assert lane.stats["received"] == 2
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_a_body_the_worker_cannot_decode_is_dead_lettered_and_its_batch_still_runs(nats_server):
    """The sidecar reads only the routing headers; a body that is not a work item is found by the
    worker, which answers that item dead_letter: DLQ copy, terminated, no NAK; the good items of
    the same batch are answered."""
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    js = gw_nc.jetstream()
    await js.add_stream(StreamConfig(**dlq_stream_config(storage="memory")))
    gw = await Gateway(gw_nc).start()
    dead: list = []

    async def on_dead(msg) -> None:
        dead.append(msg)

    await gw_nc.subscribe("sie.dlq.>", cb=on_dead)
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, nak_delay_s=30.0, batcher_max_batch_wait_ms=300.0)
        )
        try:
            warm = gw.item("req-warm", 0, model_id=MODEL, text="warm")
            await gw.publish(warm)
            await gw.wait_for([warm.work_item_id])
            good = [gw.item("req-good", i, model_id=MODEL, text=f"fine {i}", total=2) for i in range(2)]
            poisoned = gw.item("req-poison", 0, model_id=MODEL, text="looks fine")
            await gw.publish(good[0])
            await gw.publish_raw(MODEL, POISON, headers=gw.message(poisoned).headers)
            await gw.publish(good[1])
            got = await gw.wait_for([g.work_item_id for g in good])
            assert all(r[0].success for r in got.values())
            await wait_until(lambda: dead, 10)
            assert dead[0].data == POISON
            assert dead[0].headers[DLQ_REASON_HEADER].startswith("undecodable work item:")
            await wait_until(lambda: lane.stats["dead_lettered"] == 1, 10)
            await _work_stream_empties(js)
            assert lane.stats["naked"] == 0
            # its routing header names its inbox: the request is answered now, not at its deadline
            answer = (await gw.wait_for([poisoned.work_item_id]))[poisoned.work_item_id][0]
            assert not answer.success and answer.error_code == "INTERNAL_ERROR"
            assert "undecodable work item" in answer.error
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()
