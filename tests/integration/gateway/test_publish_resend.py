"""A work publish whose ack died with the NATS connection is sent again at the reconnect."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import nats

from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from protocol.subjects import pool_stream_name, work_subject


async def test_a_publish_lost_with_the_server_is_sent_again_at_the_reconnect(nats_server):
    holder: dict[str, Dispatcher] = {}

    async def reconnected() -> None:
        holder["d"].on_reconnect()

    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                            reconnected_cb=reconnected)
    try:
        d = holder["d"] = Dispatcher(nc, metrics=GatewayMetrics(), storage="file", publish_timeout_s=30.0)
        await d.ensure_stream("default")
        subject = work_subject("default", "cpu", "default", "m")
        assert nats_server.proc is not None
        os.kill(nats_server.proc.pid, signal.SIGSTOP)  # the publish reaches a server that never answers
        publish = asyncio.create_task(d._publish(subject, "default", b"payload", {"Nats-Msg-Id": "item-1"}))
        await asyncio.sleep(0.5)
        assert not publish.done()
        os.kill(nats_server.proc.pid, signal.SIGKILL)  # ... and dies with it unread
        nats_server.proc.wait(5)
        nats_server.start()  # same port, same store: the stream is still there
        t0 = time.monotonic()
        await asyncio.wait_for(publish, 10.0)  # far inside the 30 s publish timeout
        assert time.monotonic() - t0 < 10.0
        info = await nc.jetstream().stream_info(pool_stream_name("default"))
        assert info.state.messages == 1
    finally:
        await nc.close()
