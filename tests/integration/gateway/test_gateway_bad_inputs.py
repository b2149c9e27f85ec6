"""Inputs that once answered 500 (issue 12): each is a 400 with the contract's code."""

from __future__ import annotations

import asyncio
import json

import nats.js.errors
import numpy as np
import pytest

from tests.integration.gateway.conftest import DENSE, RERANK
from tests.integration.gateway.fake_worker import FakeWorker, fake_vector
from tests.integration.gateway.test_gateway_flow import post, wait_workers
from tests.support.polling import wait_until

JSON = {"Content-Type": "application/json", "Accept": "application/json", "X-SIE-SDK-Version": "0.10.1"}
DEEP = "[" * 1000 + "]" * 1000
HUGE_INT = "1" + "0" * 4400

BAD_BODIES = [
    pytest.param(f"/v1/encode/{DENSE}", '{"items":[{"text":"\\ud800"}]}', id="encode-lone-surrogate"),
    pytest.param(f"/v1/encode/{DENSE}", '{"items":[{"text":"ok","id":"\\udfff"}]}', id="encode-surrogate-id"),
    pytest.param("/v1/embeddings", f'{{"model":"{DENSE}","input":"\\ud800"}}', id="openai-lone-surrogate"),
    pytest.param(
        "/v1/embeddings", f'{{"model":"{DENSE}","input":["a","\\udc00x"]}}', id="openai-list-surrogate"
    ),
    pytest.param(
        f"/v1/score/{RERANK}", '{"query":{"text":"\\ud800"},"items":[{"text":"a"}]}', id="score-query"
    ),
    pytest.param(f"/v1/encode/{DENSE}", f'{{"items":{DEEP}}}', id="encode-deep"),
    pytest.param(f"/v1/encode/{DENSE}", f'{{"items":[{{"text":"a"}}],"options":{DEEP}}}', id="options-deep"),
    pytest.param("/v1/embeddings", DEEP, id="openai-deep"),
    pytest.param(
        f"/v1/encode/{DENSE}", f'{{"items":[{{"text":"a"}}],"options":{{"x":{HUGE_INT}}}}}', id="huge-int"
    ),
    pytest.param(f"/v1/score/{RERANK}", HUGE_INT, id="score-huge-int"),
    pytest.param(
        f"/v1/encode/{DENSE}",
        '{"items":[{"text":"a"}],"params":{"options":{"pooling":"median"}}}',
        id="pooling",
    ),
]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
async def test_malformed_input_is_a_400_with_the_contract_code(nats_server, start_gateway, path, body):
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        async with h.session.post(h.url(path), data=body.encode(), headers=JSON) as resp:
            raw = await resp.read()
            assert resp.status == 400, raw
            doc = json.loads(raw)
            if path == "/v1/embeddings":
                assert doc["error"]["type"] == "invalid_request_error", doc
            else:
                assert doc["detail"]["code"] == "INVALID_INPUT", doc
            assert resp.headers["X-SIE-Error-Code"] == "INVALID_INPUT"
        status, _, good = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "still fine"}]})
        assert status == 200, good
    finally:
        await w.stop()


async def test_a_body_shorter_than_its_content_length_times_out(nats_server, start_gateway):
    h = await start_gateway(gateway_body_timeout_s=1.0)
    host, port = h.server.host, h.server.port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST /v1/encode/{DENSE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f'Accept: application/json\r\nContent-Length: 1000\r\n\r\n{{"items":'.encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # generous: "no hang"
        assert head.split(b" ")[1] == b"408", head
        assert b"X-SIE-Error-Code: INVALID_INPUT" in head
    finally:
        writer.close()


@pytest.mark.parametrize(
    "body", [DEEP, HUGE_INT, '{"name":"\\ud800"}'], ids=["deep", "huge-int", "surrogate"]
)
async def test_malformed_pool_body_is_a_400(start_gateway, body):
    h = await start_gateway(admin_token="pool-admin")  # admin routes need it in every auth mode
    admin = {**JSON, "Authorization": "Bearer pool-admin"}
    async with h.session.post(h.url("/v1/pools"), data=body.encode(), headers=admin) as resp:
        raw = await resp.read()
        assert resp.status == 400, raw
        assert resp.headers["X-SIE-Error-Code"] == "INVALID_INPUT"


async def test_an_item_over_the_queue_message_limit_travels_through_the_payload_store(
    nats_server, start_gateway
):
    """An item larger than one JetStream message (the NATS server's max_payload) is put into the
    payload store and its message names it (issue 34); the object is gone once the request ended."""
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        max_payload = h.gateway.nc.max_payload
        assert max_payload == 1024 * 1024  # nats-server's default, as `sie up` runs it
        big = "x" * (3 * max_payload)
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "ok"}, {"text": big}]})
        assert status == 200, body
        np.testing.assert_array_equal(body["items"][1]["dense"]["values"], fake_vector(big))
        assert [wi.item.text == big for wi in w.seen] == [False, True]
        assert [bool(hdr.get("Sie-Payload")) for hdr in w.seen_headers] == [False, True]
        assert "sie_gateway_queue_payload_offloads_total 1.0" in h.gateway.metrics.render().decode()
        store = await h.nc.jetstream().object_store("SIE_PAYLOADS")

        async def forgotten() -> bool:
            try:
                return not await store.list(ignore_deletes=True)
            except nats.js.errors.NotFoundError:  # nothing in the store
                return True

        await wait_until(forgotten, 10, what="the payload deleted")
    finally:
        await w.stop()
