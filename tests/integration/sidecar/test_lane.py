"""The sidecar against a real nats-server and a real worker IPC server (Runtime + fake adapter)."""

from __future__ import annotations

import asyncio
import json

from protocol.codec import unpackb
from protocol.subjects import HEALTH_SOLICIT, direct_subject, work_cancel_subject, work_subject
from protocol.work import Heartbeat
from tests.integration.sidecar.support import (
    Gateway,
    InProcessWorker,
    connect,
    heartbeats,
    model_yaml,
    settled_consumer,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)
from tests.support.polling import wait_until

MODEL = "test/fake-embed"


async def test_items_are_batched_answered_and_acked(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    health = await heartbeats(gw_nc, Heartbeat.parse)
    async with InProcessWorker(sock, model_yaml(MODEL, load_delay_s=0.5)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        try:
            items = [gw.item("req-a", i, model_id=MODEL, text=f"item {i} text", total=20) for i in range(20)]
            for it in items:
                await gw.publish(it)
            got = await gw.wait_for([it.work_item_id for it in items])
            for it in items:
                (res,) = got[it.work_item_id]
                assert res.success, res.error
                assert res.request_id == "req-a" and res.item_index == it.item_index
                assert res.worker_id == lane.settings.worker_id
                dense = unpackb(res.result_msgpack)["dense"]
                assert dense["dims"] == 8
            # the model load was waited out with progress acks, never a NAK
            assert lane.stats["naked"] == 0
            assert lane.stats["batches"] < 20  # items shared forward passes
            await settled_consumer(lane.js, lane.stream, lane.durable)
            await wait_until(lambda: any(MODEL in h.loaded_models and h.ready for h in health), 10)
            beat = health[-1]
            assert (beat.pool_name, beat.machine_profile, beat.bundle) == ("default", "cpu", "default")
        finally:
            await stop_lane(lane, nc, client)
        await wait_until(lambda: health and health[-1].terminated, 5)
        assert health[-1].ready is False
    await gw_nc.close()


async def test_a_gateway_that_asks_gets_the_heartbeat_at_once(nats_server):
    """Heartbeats once a minute, and one more whenever a gateway asks (it starts, or reconnected):
    the answer names the worker as the periodic beat does."""
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    health = await heartbeats(gw_nc, Heartbeat.parse)
    async with InProcessWorker(sock, model_yaml(MODEL)):
        settings = sidecar_settings(nats_server.url, sock, health_publish_interval_ms=60_000)
        lane, nc, client = await start_lane(settings)
        try:
            await wait_until(lambda: health, 10, what="the first heartbeat")
            await asyncio.sleep(1.0)  # readiness settles: no beat is due for a minute
            before = len(health)
            await gw_nc.publish(HEALTH_SOLICIT, b"")
            await wait_until(lambda: len(health) > before, 10, what="the asked-for heartbeat")
            assert health[-1].name == settings.worker_id and not health[-1].terminated
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_malformed_messages_never_disturb_other_work(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, nak_delay_s=5.0))
        try:
            await gw.publish_raw(MODEL, b"\xc1 not msgpack at all")
            await gw.publish_raw(MODEL, b"\x93\x01\x02\x03")  # msgpack, but a list
            await gw.publish_raw(MODEL, b"\x81\xa3foo\xa3bar")  # a map without the required keys
            bad_reply = gw.item("req-bad", 0, model_id=MODEL, text="x", reply_subject="sie.not.an.inbox")
            await gw.publish(bad_reply)
            unknown_op = gw.item("req-op", 0, model_id=MODEL, text="x")
            msg = gw.message(unknown_op)
            route = json.loads(msg.headers["Sie-Route"])
            route[3] = "teleport"  # its operation
            await gw.publish_raw(MODEL, msg.payload, {**msg.headers, "Sie-Route": json.dumps(route)})
            good = [gw.item("req-ok", i, model_id=MODEL, text=f"fine {i}", total=5) for i in range(5)]
            for it in good:
                await gw.publish(it)

            got = await gw.wait_for([it.work_item_id for it in good] + [unknown_op.work_item_id])
            assert all(got[it.work_item_id][0].success for it in good)
            (err,) = got[unknown_op.work_item_id]
            assert not err.success and err.error_code == "INVALID_INPUT"
            assert bad_reply.work_item_id not in gw.results
            # garbage was dead-lettered at once (3 messages; issue 12: no NAK cycle), the bad reply
            # subject ack-dropped
            await wait_until(lambda: lane.stats["dead_lettered"] == 3 and lane.stats["dropped"] >= 1, 10)
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_cancelled_requests_are_dropped_before_running(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    async with InProcessWorker(sock, model_yaml(MODEL, load_delay_s=1.5)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        try:
            doomed = [gw.item("req-doomed", i, model_id=MODEL, text=f"d {i}", total=3) for i in range(3)]
            kept = [gw.item("req-kept", i, model_id=MODEL, text=f"k {i}", total=3) for i in range(3)]
            for it in doomed + kept:
                await gw.publish(it)
            # while the model loads the items wait in the scheduler; the gateway gives up on one request
            await wait_until(lambda: lane.queue_depth() == 6, 10)
            await gw_nc.publish(work_cancel_subject(gw.router_id, "req-doomed"), b"")
            got = await gw.wait_for([it.work_item_id for it in kept])
            assert all(r[0].success for r in got.values())
            await asyncio.sleep(0.5)
            assert not any(it.work_item_id in gw.results for it in doomed)
            assert lane.stats["dropped"] == 3
            # a late redelivery of a cancelled request is dropped at intake too
            late = gw.item("req-doomed", 7, model_id=MODEL, text="late", total=8)
            await gw.publish(late)
            await wait_until(lambda: lane.stats["dropped"] == 4, 10)
            assert late.work_item_id not in gw.results
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_permanent_load_failure_is_answered(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    broken = "test/broken"
    async with InProcessWorker(sock, model_yaml(MODEL), model_yaml(broken, fail_load="weights are corrupt")):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        try:
            bad = [gw.item("req-broken", i, model_id=broken, text="x", total=2) for i in range(2)]
            missing = gw.item("req-missing", 0, model_id="no/such-model", text="x")
            good = gw.item("req-good", 0, model_id=MODEL, text="fine")
            for it in [*bad, missing, good]:
                await gw.publish(it)
            got = await gw.wait_for([it.work_item_id for it in [*bad, missing, good]])
            for it in bad:
                (res,) = got[it.work_item_id]
                assert not res.success and res.error_code == "MODEL_LOAD_FAILED"
            assert got[missing.work_item_id][0].error_code == "MODEL_NOT_FOUND"
            assert got[good.work_item_id][0].success
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_oom_is_naked_without_publishing_then_served(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    # the first dispatches run out of memory, past the worker's own recovery (split batch)
    async with InProcessWorker(sock, model_yaml(MODEL, oom_on_batch=1, oom_repeat=40)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, oom_nak_delay_s=0.5))
        try:
            items = [gw.item("req-oom", i, model_id=MODEL, text=f"o {i}", total=2) for i in range(2)]
            for it in items:
                await gw.publish(it)
            got = await gw.wait_for([it.work_item_id for it in items], timeout=90)
            for it in items:
                # exactly one answer each: the OOM outcomes were NAKed, not published
                assert len(got[it.work_item_id]) == 1 and got[it.work_item_id][0].success
            assert lane.stats["naked"] >= 2
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_heartbeat_json_shape(nats_server):
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    beats = await heartbeats(gw_nc, json.loads)
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock, worker_id="pod-0"))
        try:
            await wait_until(lambda: any(b["ready"] for b in beats), 10)
            beat = beats[-1]
            for key in (
                "name",
                "ready",
                "terminated",
                "machine_profile",
                "pool_name",
                "bundle",
                "bundle_config_hash",
                "loaded_models",
                "queue_depth",
                "pending_cost",
                "inflight_batches",
                "saturated",
            ):
                assert key in beat
            assert beat["name"] == "pod-0"
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_an_idle_worker_gets_a_lone_item_without_the_batch_wait(nats_server):
    """With a batch wait of ten minutes, lone items still run: the worker has nothing of the model
    to do, so waiting for a fuller batch would only add latency (items batch while it is busy)."""
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(
            sidecar_settings(nats_server.url, sock, batcher_max_batch_wait_ms=600_000)
        )
        try:
            for n in range(3):
                item = gw.item(f"lone-{n}", 0, model_id=MODEL, text="one item alone", total=1)
                await gw.publish(item)
                got = await gw.wait_for([item.work_item_id], timeout=30)
                assert got[item.work_item_id][0].success
        finally:
            await stop_lane(lane, nc, client)


async def test_each_batch_the_worker_runs_is_one_group_cut_by_the_sidecar(nats_server):
    """The sidecar's batch is the one batching decision: every RunBatch holds items of one group
    (operation, parameters, LoRA), so the worker runs it as handed; the items it gets are the
    published bytes, decoded once there."""
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    async with InProcessWorker(sock, model_yaml(MODEL, batch_delay_ms=100)) as worker:
        batches: list[list] = []
        run = worker.runtime.run_work_items

        async def recording(items, **kw):
            batches.append(items)
            return await run(items, **kw)

        worker.runtime.run_work_items = recording  # type: ignore[method-assign]
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        try:
            kinds = [
                {},
                {"instruction": "query: "},
                {"is_query": True},
                {
                    "options": {"tag": "b"}
                },  # (a LoRA is a param: see test_the_batch_key_follows_what_decides_how_items_run)
                {"output_dtype": "float16"},
            ]
            items = []
            for i in range(30):  # interleaved: every neighbour differs from the one before
                extra = kinds[i % len(kinds)]
                items.append(
                    gw.item(f"req-{i % len(kinds)}-{i}", 0, model_id=MODEL, text=f"text {i}", **extra)
                )
            for it in items:
                await gw.publish(it)
            got = await gw.wait_for([it.work_item_id for it in items], timeout=60)
            assert len(got) == len(items)
            assert all(got[it.work_item_id][0].success for it in items), [r[0].error for r in got.values()]
            assert sum(len(b) for b in batches) == len(items)
            assert len(batches) < len(items)  # groups still share batches
            for batch in batches:
                assert len({it.job.batch_key for it in batch}) == 1, [it.job.batch_key for it in batch]
            # the groups are the five kinds, each kept apart
            assert len({b[0].job.batch_key for b in batches}) == len(kinds)
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_a_batchs_results_for_one_gateway_share_a_message(nats_server):
    """Items whose gateway names a results subject get their results in as few messages as the batch
    allows, each item still acked; items without one keep a message each on their reply subject."""
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    # the model loads for half a second: the items wait for it and run as batches of several
    async with InProcessWorker(sock, model_yaml(MODEL, load_delay_s=0.5)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        try:
            together = [gw.item(f"req-{r}", i, model_id=MODEL, text=f"t {r} {i}", total=6)
                        for r in "ab" for i in range(6)]  # fmt: skip
            for it in together:
                await gw.publish(it, together=True)
            got = await gw.wait_for([it.work_item_id for it in together])
            for it in together:
                (res,) = got[it.work_item_id]
                assert res.success and res.request_id == it.request_id and res.item_index == it.item_index
            assert gw.together == 12 and gw.messages < 12, (gw.together, gw.messages)
            assert lane.stats["published"] == 12
            await settled_consumer(lane.js, lane.stream, lane.durable)

            before, dropped = gw.messages, lane.stats["dropped"]
            alone = [gw.item("req-c", i, model_id=MODEL, text=f"c {i}", total=3) for i in range(3)]
            for it in alone:
                await gw.publish(it)
            # a results subject outside the inbox namespace: dropped, like a bad reply subject
            forged = gw.item("req-d", 0, model_id=MODEL, text="d")
            msg = gw.message(forged, 1, "sie.elsewhere")
            await gw.publish_raw(MODEL, msg.payload, msg.headers)
            await gw.wait_for([it.work_item_id for it in alone])
            assert gw.messages - before == 3 and gw.together == 12
            await wait_until(lambda: lane.stats["dropped"] == dropped + 1, 10)
            assert forged.work_item_id not in gw.results
            await settled_consumer(lane.js, lane.stream, lane.durable)
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()


async def test_items_sent_on_the_direct_path_are_answered_and_nothing_is_settled(nats_server):
    # what the gateway sends while the lane's stream or durable has no leader (docs/ha.md): core NATS
    # messages on sie.direct.<work subject>, no reply subject; answered like deliveries, never ACKed
    sock = socket_path()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    async with InProcessWorker(sock, model_yaml(MODEL)):
        lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
        try:
            # first one item through the stream: once it is answered the worker is known and the model
            # loaded (a direct item the sidecar cannot run yet is dropped, for the gateway to send
            # again, which this test does not), and the sidecar's subscriptions are in place
            warm = gw.item("req-w", 0, model_id=MODEL, text="warm up")
            await gw.publish(warm)
            await gw.wait_for([warm.work_item_id])
            await settled_consumer(lane.js, lane.stream, lane.durable)
            seq = (await lane.js.stream_info(lane.stream)).state.last_seq
            takes: list[str] = []

            async def took(msg) -> None:
                takes.append(msg.subject)

            await gw_nc.subscribe("_INBOX.gw.taken.>", cb=took)
            items = [gw.item("req-d", i, model_id=MODEL, text=f"direct {i}", total=6) for i in range(6)]
            for it in items:
                await gw.publish_direct(it, request_items=6, taken=f"_INBOX.gw.taken.req-d.{it.item_index}")
            got = await gw.wait_for([it.work_item_id for it in items])
            assert all(res.success for (res,) in got.values())
            assert lane.stats["direct"] == 6
            # each said it was taken, on the subject its message named
            await wait_until(lambda: len(takes) == 6, 5, what="six takes")
            assert sorted(takes) == [f"_INBOX.gw.taken.req-d.{i}" for i in range(6)]
            # nothing went through the stream, and nothing was sent to it in the items' name
            info = await lane.js.stream_info(lane.stream)
            assert info.state.messages == 0 and info.state.last_seq == seq
            consumer = await lane.js.consumer_info(lane.stream, lane.durable)
            assert consumer.delivered.stream_seq == seq and consumer.num_ack_pending == 0
            # a message with a reply subject is no direct one: dropped, not run
            await gw_nc.publish(
                direct_subject(work_subject("default", "cpu", "default", MODEL)),
                b"x",
                reply="_INBOX.somebody.else",
            )
            await gw_nc.flush()
            await asyncio.sleep(0.3)
            assert lane.stats["direct"] == 6
        finally:
            await stop_lane(lane, nc, client)
    await gw_nc.close()
