"""The pool work stream as the gateway and the sidecar ensure it, against a real nats-server."""

from __future__ import annotations

import nats

from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from protocol.subjects import pool_stream_name
from sidecar.streams import ensure_stream
from tests.integration.sidecar.support import sidecar_settings


async def test_a_sidecar_keeps_the_operators_stream_limits(nats_server):
    """SIE_STREAM_MAX_MSGS is a gateway setting: a sidecar (re-)ensuring the stream must not reset it."""
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        gateway = Dispatcher(nc, metrics=GatewayMetrics(), storage="memory", max_msgs=5_000, max_age_s=600.0)
        await gateway.streams.ensure_stream("default")
        info = await js.stream_info(pool_stream_name("default"))
        assert info.config.max_msgs == 5_000 and info.config.max_age == 600.0

        settings = sidecar_settings(nats_server.url, "/tmp/unused.sock", stream_storage="memory")
        assert await ensure_stream(js, settings) == pool_stream_name("default")
        info = await js.stream_info(pool_stream_name("default"))
        assert info.config.max_msgs == 5_000
        assert info.config.max_age == 600.0
    finally:
        await nc.close()


async def test_a_sidecar_creates_a_missing_stream_and_the_gateway_then_applies_its_limits(nats_server):
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        settings = sidecar_settings(nats_server.url, "/tmp/unused.sock", stream_storage="memory")
        await ensure_stream(js, settings)
        info = await js.stream_info(pool_stream_name("default"))
        assert info.config.max_msgs == 100_000 and info.config.subjects == [
            "sie.work.default.*.*.*",
            "sie.work.default.*.*.*.bulk",
        ]

        gateway = Dispatcher(nc, metrics=GatewayMetrics(), storage="memory", max_msgs=7_000)
        await gateway.streams.ensure_stream("default")
        info = await js.stream_info(pool_stream_name("default"))
        assert info.config.max_msgs == 7_000
    finally:
        await nc.close()
