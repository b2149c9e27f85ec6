"""Reading key-value buckets (gateway/kv.py) and object stores (iokit/payloads.py) against a
real nats-server: what a listing and a mirror return, and that no read leaves consumers behind on
the server (nats-py's own ``KeyValue.keys`` left one per call for minutes: about 45 a minute from a
gateway's loops)."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig

import gateway.kv
from gateway.kv import LISTING_IDLE_S, KeyValueMirror, bucket_keys
from iokit.payloads import READER_IDLE_S, PayloadStore
from protocol.streams import PAYLOADS_BUCKET as PAYLOADS
from tests.support.polling import wait_until


@pytest.fixture
async def js(nats_server):
    nc = await nats.connect(nats_server.url)
    yield nc.jetstream()
    await nc.close()


async def consumers(js, bucket: str) -> int:
    return (await js.stream_info(f"KV_{bucket}")).state.consumer_count


async def test_a_listing_names_the_live_keys_and_leaves_no_consumer(js):
    kv = await js.create_key_value(KeyValueConfig(bucket="LISTED", history=1))
    assert await bucket_keys(kv) == []  # an empty bucket is an empty list, not an error
    for key in ("a", "b", "c", "d"):
        await kv.put(key, key.encode())
    await kv.delete("b")
    await kv.purge("d")
    for _ in range(10):
        assert await bucket_keys(kv) == ["a", "c"]

    async def none_left() -> bool:
        return await consumers(js, "LISTED") == 0

    # fails on kv.keys(): its ten consumers stay
    await wait_until(
        none_left, timeout_s=LISTING_IDLE_S + 30, interval_s=0.5, what="listings' consumers gone"
    )


async def test_a_mirror_follows_the_bucket_through_one_consumer(js, monkeypatch):
    monkeypatch.setattr(gateway.kv, "MIRROR_IDLE_S", 1.0)
    kv = await js.create_key_value(KeyValueConfig(bucket="MIRRORED", history=1))
    before = await kv.put("before", b"1")
    await kv.put("gone-before", b"x")
    await kv.delete("gone-before")
    mirror = KeyValueMirror(kv, "MIRRORED")
    task = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.loaded.wait(), 10)
        assert {k: (e.value, e.revision) for k, e in mirror.entries.items()} == {"before": (b"1", before)}
        after = await kv.put("after", b"2")
        changed = await kv.update("before", b"3", last=before)
        await kv.put("brief", b"4")
        await kv.delete("brief")

        def follows() -> bool:
            seen = {k: (e.value, e.revision) for k, e in mirror.entries.items()}
            return seen == {"before": (b"3", changed), "after": (b"2", after)}

        await wait_until(follows, timeout_s=10, what="the mirror to show the bucket's changes")
        assert await consumers(js, "MIRRORED") == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def none_left() -> bool:
        return await consumers(js, "MIRRORED") == 0

    await wait_until(
        none_left, timeout_s=30, interval_s=0.5, what="the mirror's consumer gone after it stopped"
    )


async def test_a_mirror_follows_on_after_the_server_lost_its_consumer(nats_server, monkeypatch):
    """kill -9 and a restart of the server (the mirror's consumer lived in its memory): nats-py
    notices the heartbeats stopped and makes the consumer again from the next entry; the mirror
    sees what was written after the restart, and the bucket's earlier state stays."""
    monkeypatch.setattr(gateway.kv, "MIRROR_IDLE_S", 1.0)
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket="SURVIVES", history=1))
        await kv.put("before", b"1")
        mirror = KeyValueMirror(kv, "SURVIVES")
        task = asyncio.create_task(mirror.run())
        try:
            await asyncio.wait_for(mirror.loaded.wait(), 10)
            nats_server.restart(kill=True)

            async def written() -> bool:  # once JetStream has its streams back
                try:
                    await kv.put("after", b"2")
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                    return False
                return True

            await wait_until(written, timeout_s=30, interval_s=0.2, what="a write after the restart")
            await kv.delete("before")

            def follows() -> bool:
                return {k: e.value for k, e in mirror.entries.items()} == {"after": b"2"}

            await wait_until(
                follows, timeout_s=60, interval_s=0.2, what="the mirror to follow after the restart"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await nc.close()


async def test_object_reads_leave_no_consumer(js):
    """The payload store (and the Batch API's files) read objects through nats-py, whose read
    consumer is neither deleted nor given an inactivity threshold: the bucket's stream gives it one."""
    store = PayloadStore(js, storage="memory")
    await store.put("big", b"x" * 300_000)  # several chunks
    for _ in range(5):
        assert await store.get("big") == b"x" * 300_000
    limits = (await js.stream_info(f"OBJ_{PAYLOADS}")).config.consumer_limits
    assert limits is not None and limits.inactive_threshold == READER_IDLE_S

    async def none_left() -> bool:
        return (await js.stream_info(f"OBJ_{PAYLOADS}")).state.consumer_count == 0

    await wait_until(
        none_left, timeout_s=READER_IDLE_S + 30, interval_s=0.5, what="the reads' consumers gone"
    )
