"""Config deltas through a real nats-server into a real sidecar and worker:
own bundle/pool only (who may publish a delta is NATS's to say: tests/helm/test_chart_security.py), stale epochs ignored, the advertised hash moves only
when the worker's computed hash matches, and an apply waits for the batch in flight."""

from __future__ import annotations

import asyncio
import json

from protocol.config_delta import ConfigDelta, encode_config_delta
from protocol.model_config import Bundle, bundle_config_hash, parse_model_yaml
from protocol.subjects import config_subject, health_subject
from protocol.work import Heartbeat
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

ADAPTERS = ["worker.adapters.fake"]
BUNDLE = Bundle(name="default", adapters=ADAPTERS)


def expected_hash(*yamls: str, pool: str = "default") -> str:
    return bundle_config_hash(BUNDLE, [parse_model_yaml(y) for y in yamls], pool=pool)


def delta(
    model_id: str,
    yaml_text: str,
    epoch: int,
    hash_: str,
    *,
    router_id: str = "sie-config",
    bundle: str = "default",
    pool: str = "default",
) -> bytes:
    return encode_config_delta(
        ConfigDelta(
            router_id=router_id,
            bundle_id=bundle,
            epoch=epoch,
            bundle_config_hash=hash_,
            model_id=model_id,
            profiles_added=["default"],
            model_config=yaml_text,
            affected_bundles=[bundle],
            pool=pool,
            bundle_pool_config_hashes={bundle: {pool: hash_}},
            bundle_adapters={bundle: ADAPTERS},
        )
    )


class Heartbeats:
    def __init__(self, nc, worker_id: str) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.seen: list[Heartbeat] = []

    async def start(self) -> Heartbeats:
        async def cb(msg):
            self.seen.append(Heartbeat.parse(msg.data))

        await self.nc.subscribe(health_subject(self.worker_id), cb=cb)
        await self.nc.flush()
        return self

    async def next(self, timeout: float = 10.0) -> Heartbeat:
        n = len(self.seen)
        await wait_until(lambda: len(self.seen) > n, timeout)
        return self.seen[-1]


async def test_deltas_verified_and_stale(nats_server):
    a = model_yaml("test/a")
    b = model_yaml("test/b")
    c = model_yaml("test/c")
    d = model_yaml("test/d")
    sock = socket_path()
    async with InProcessWorker(sock, a) as worker:
        settings = sidecar_settings(nats_server.url, sock)
        pub = await connect(nats_server.url)
        lane, nc, client = await start_lane(settings)
        try:
            applier = lane.config
            beats = await Heartbeats(pub, settings.worker_id).start()
            await wait_until(lambda: lane.worker.last_ok is not None, 10)

            async def send(data: bytes, outcome: str) -> None:
                before = applier.stats.get(outcome, 0)
                await pub.publish(config_subject("default"), data)
                await pub.flush()
                await wait_until(lambda: applier.stats.get(outcome, 0) > before, 15)

            # a delta for a new model: applied, verified, advertised
            h_ab = expected_hash(a, b)
            await send(delta("test/b", b, 1, h_ab), "applied")
            assert "test/b" in worker.runtime.catalog
            assert applier.epoch == 1 and applier.verified_hash == h_ab
            assert (await beats.next()).bundle_config_hash == h_ab

            # another bundle or pool, or a stale epoch: ignored, worker untouched
            await send(delta("test/c", c, 2, "x", bundle="other"), "other_bundle")
            await send(delta("test/c", c, 2, "x", pool="gpu-team"), "other_pool")
            await send(delta("test/c", c, 1, expected_hash(a, b, c)), "stale")
            assert "test/c" not in worker.runtime.catalog
            assert applier.epoch == 1

            # from another config pod (any router_id): applied
            h_abc = expected_hash(a, b, c)
            await send(delta("test/c", c, 2, h_abc, router_id="sie-config-7f9c"), "applied")
            assert applier.verified_hash == h_abc

            # hash mismatch: the worker took the config but nothing advances
            await send(delta("test/d", d, 3, "0" * 64), "mismatch")
            assert "test/d" in worker.runtime.catalog
            assert applier.epoch == 2 and applier.verified_hash == h_abc
            assert worker.runtime.bundle_config_hash() == expected_hash(a, b, c, d) != h_abc
            assert (await beats.next()).bundle_config_hash == h_abc
            assert (await beats.next()).bundle_config_hash == h_abc
        finally:
            await stop_lane(lane, nc, client)
            await pub.close()


async def test_apply_waits_for_the_batch_in_flight(nats_server):
    slow = model_yaml("test/slow", batch_delay_ms=1500)
    extra = model_yaml("test/extra")
    sock = socket_path()
    async with InProcessWorker(sock, slow) as worker:
        settings = sidecar_settings(nats_server.url, sock)
        pub = await connect(nats_server.url)
        gw = await Gateway(pub).start()
        lane, nc, client = await start_lane(settings)
        try:
            await wait_until(lambda: lane.worker.last_ok is not None, 10)
            # warm up (load) so the timed batch is just the slow forward pass
            await gw.publish(gw.item("warm", 0, model_id="test/slow", text="warm"))
            await gw.wait_for(["warm.0"], timeout=30)
            await gw.publish(gw.item("req", 0, model_id="test/slow", text="slow one"))
            await wait_until(lambda: lane.inflight_batches == 1 and lane.barrier.shared_holders == 1, 15)
            await pub.publish(
                config_subject("default"), delta("test/extra", extra, 1, expected_hash(slow, extra))
            )
            await pub.flush()
            # The first moment the worker has the new model, the slow batch (1.5 s on the worker)
            # is off the worker: the apply waited for it. Without the barrier the apply would land
            # within milliseconds, while the batch still runs.
            batches_on_worker = await wait_until(
                lambda: "test/extra" in worker.runtime.catalog and [lane.schedulers["test/slow"].running],
                15,
                interval_s=0.005,
                what="the apply",
            )
            assert batches_on_worker == [0]
            await wait_until(lambda: lane.config.stats.get("applied", 0) == 1, 15)
            # the batch the apply waited for is answered (not NAKed or lost to the apply). The
            # barrier covers the batch on the worker only, and the result travels through NATS to
            # this test's subscriber: it may arrive after the apply is counted, so wait for it.
            got = await gw.wait_for(["req.0"], timeout=30)
            assert got["req.0"][0].success
        finally:
            await stop_lane(lane, nc, client)
            await pub.close()


def test_delta_bytes_are_json():
    data = delta("m", "sie_id: m", 1, "h")
    assert json.loads(data)["router_id"] == "sie-config"


async def test_barrier_writer_waits_for_readers_and_blocks_new_ones():
    from sidecar.barrier import ExecutionBarrier

    barrier = ExecutionBarrier()
    order: list[str] = []
    release = asyncio.Event()

    async def batch(name: str) -> None:
        async with barrier.shared():
            order.append(f"{name}+")
            await release.wait()
            order.append(f"{name}-")

    async def apply() -> None:
        async with barrier.exclusive():
            order.append("apply")

    b1 = asyncio.create_task(batch("b1"))
    await asyncio.sleep(0.01)
    ap = asyncio.create_task(apply())
    await asyncio.sleep(0.01)
    b2 = asyncio.create_task(batch("b2"))  # arrives while the apply waits: goes after it
    await asyncio.sleep(0.01)
    assert order == ["b1+"]
    release.set()
    await asyncio.wait_for(asyncio.gather(b1, ap, b2), 5)
    assert order == ["b1+", "b1-", "apply", "b2+", "b2-"]


def tombstone(
    model_id: str, epoch: int, hash_: str, *, bundle: str = "default", pool: str = "default"
) -> bytes:
    return encode_config_delta(
        ConfigDelta(
            router_id="sie-config", bundle_id=bundle, epoch=epoch, bundle_config_hash=hash_, model_id=model_id,
            deleted=True, pool=pool, bundle_pool_config_hashes={bundle: {pool: hash_}},
            bundle_adapters={bundle: ADAPTERS},
        )
    )  # fmt: skip


async def test_tombstone_unloads_and_forgets_the_model(nats_server):
    a = model_yaml("test/a")
    b = model_yaml("test/b")
    sock = socket_path()
    async with InProcessWorker(sock) as worker:  # no image models: both come by delta
        settings = sidecar_settings(nats_server.url, sock)
        pub = await connect(nats_server.url)
        gw = await Gateway(pub).start()
        lane, nc, client = await start_lane(settings)
        try:
            applier = lane.config
            await wait_until(lambda: lane.worker.last_ok is not None, 10)

            async def send(data: bytes, outcome: str) -> None:
                before = applier.stats.get(outcome, 0)
                await pub.publish(config_subject("default"), data)
                await pub.flush()
                await wait_until(lambda: applier.stats.get(outcome, 0) > before, 15)

            await send(delta("test/a", a, 1, expected_hash(a)), "applied")
            await send(delta("test/b", b, 2, expected_hash(a, b)), "applied")
            await gw.publish(gw.item("r", 0, model_id="test/b", text="load me"))
            await gw.wait_for(["r.0"], timeout=30)
            assert "test/b" in worker.runtime.loaded_models()

            # a tombstone from another pool is not ours
            await send(tombstone("test/b", 3, expected_hash(a), pool="gpu-team"), "other_pool")
            assert "test/b" in worker.runtime.catalog
            await send(tombstone("test/b", 3, expected_hash(a)), "applied")
            assert "test/b" not in worker.runtime.catalog
            assert "test/b" not in worker.runtime.loaded_models()
            assert applier.epoch == 3 and applier.verified_hash == expected_hash(a)
            # the last model of the bundle goes: the empty hash is the right one
            await send(tombstone("test/a", 4, ""), "applied")
            assert len(worker.runtime.catalog) == 0 and applier.verified_hash == ""
            # a request for the deleted model now fails as not found
            await gw.publish(gw.item("late", 0, model_id="test/b", text="gone"))
            results = await gw.wait_for(["late.0"], timeout=30)
            assert results["late.0"][0].error_code == "MODEL_NOT_FOUND"
        finally:
            await stop_lane(lane, nc, client)
            await pub.close()
