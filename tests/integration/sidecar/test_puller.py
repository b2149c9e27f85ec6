"""The sidecar's pull requests (sidecar.puller) against a real nats-server: a delivery is handed on
when it arrives, not when its request ends; a status ends only the request it answers."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from sidecar.puller import Puller
from tests.support.polling import wait_until


@pytest.fixture
async def js_client(nats_server):
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="S", subjects=["s.>"], storage="memory"))
    await js.add_consumer("S", ConsumerConfig(durable_name="d", ack_policy=AckPolicy.EXPLICIT))
    try:
        yield nc, js
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def started_puller(nc, *, expires_s: float, durable: str = "d"):
    """A started Puller, the wake event it sets and, for each delivery, whether its request was
    still open when it was handed on, and its data."""
    wake = asyncio.Event()
    got: list[tuple[bool, bytes]] = []

    async def on_message(msg) -> None:
        got.append((puller.is_open, msg.data))
        await msg.ack()

    puller = Puller(nc, "S", durable, on_message, expires_s=expires_s, wake=wake)
    await puller.start()
    try:
        yield puller, wake, got
    finally:
        await puller.stop()


async def test_each_delivery_is_handed_on_while_its_request_stays_open(js_client):
    nc, js = js_client
    async with started_puller(nc, expires_s=30.0) as (puller, wake, got):
        await puller.request(10)
        for i in range(3):
            await js.publish("s.x", str(i).encode())
            await wait_until(lambda i=i: len(got) == i + 1, 5)
            # handed on one by one while the request (30 s, batch of 10) stays open
            assert got[-1] == (True, str(i).encode())
        assert puller.is_open and puller.owed == 7
        assert not wake.is_set()


async def test_a_request_ends_when_its_batch_is_delivered_or_it_expires(js_client):
    nc, js = js_client
    async with started_puller(nc, expires_s=0.3) as (puller, wake, got):
        for i in range(2):
            await js.publish("s.x", str(i).encode())
        await puller.request(2)
        await asyncio.wait_for(wake.wait(), 5)
        assert [d for _, d in got] == [b"0", b"1"]
        assert not puller.is_open and puller.owed == 0

        wake.clear()
        await puller.request(5)  # nothing to deliver: the server's 408 ends it at its expiry
        await asyncio.wait_for(wake.wait(), 5)
        assert not puller.is_open and puller.failures == 0


async def test_a_status_left_over_from_an_earlier_request_does_not_end_the_open_one(js_client):
    nc, js = js_client
    async with started_puller(nc, expires_s=0.2) as (puller, wake, got):
        await puller.request(4)
        await asyncio.wait_for(wake.wait(), 5)  # expired: 408 on request 0
        wake.clear()
        await puller.request(4)
        # a late 408 on request 0's subject, as one that crossed the client's own timer would come
        await nc.publish(
            f"{puller._prefix}.0", b"", headers={"Status": "408", "Description": "Request Timeout"}
        )
        await nc.flush()
        await asyncio.sleep(0.05)
        assert puller.is_open and not wake.is_set()
        await js.publish("s.x", b"late")
        await wait_until(lambda: len(got) == 1, 5)
        assert got[0][1] == b"late"


async def test_pulling_from_a_missing_durable_counts_failures(js_client):
    nc, _ = js_client
    async with started_puller(nc, expires_s=1.0, durable="nobody") as (puller, wake, _):
        await puller.request(1)
        await asyncio.wait_for(wake.wait(), 5)
        assert puller.failures == 1 and puller.last_failure.startswith("503")
        assert not puller.is_open
