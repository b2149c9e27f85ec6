"""`sie serve` inputs that once answered 500 or hung (issue 12): each is a 400 INVALID_INPUT (or 408)."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.fuzz import answer_to_a_short_body
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

F = "sie-fake"
JSON = {"Content-Type": "application/json", "Accept": "application/json"}
DEEP = "[" * 1000 + "]" * 1000
HUGE_INT = "1" + "0" * 4400


@pytest.fixture
async def client():
    settings = WorkerSettings(preload_models=F, machine_profile="cpu", request_body_timeout_s=1.0)
    async with TestClient(TestServer(create_app(Runtime(settings), settings))) as c:
        yield c


BAD = [
    (f"/v1/encode/{F}", '{"items":[{"text":"\\ud800"}]}'),
    ("/v1/embeddings", f'{{"model":"{F}","input":"\\ud800"}}'),
    (f"/v1/score/{F}", '{"query":{"text":"\\udc01"},"items":[{"text":"a"}]}'),
    (f"/v1/encode/{F}", f'{{"items":{DEEP}}}'),
    (f"/v1/encode/{F}", '{"items":[{"text":"a"}],"options":' + "[" * 200 + "]" * 200 + "}"),
    (f"/v1/encode/{F}", f'{{"items":[{{"text":"a"}}],"options":{{"x":{HUGE_INT}}}}}'),
    (f"/v1/encode/{F}", '{"items":[{"text":"a"}],"options":{"x":%s}}' % ("9" * 40)),
    (f"/v1/encode/{F}", '{"items":[{"text":"a"}],"params":{"options":{"pooling":"median"}}}'),
]


@pytest.mark.parametrize(("path", "body"), BAD)
async def test_malformed_input_is_a_400(client, path, body):
    resp = await client.post(path, data=body.encode(), headers=JSON)
    raw = await resp.read()
    assert resp.status == 400, raw[:500]
    assert resp.headers["X-SIE-Error-Code"] == "INVALID_INPUT"
    doc = json.loads(raw)
    assert (doc["error"]["type"] if path == "/v1/embeddings" else doc["detail"]["code"]) in (
        "invalid_request_error",
        "INVALID_INPUT",
    ), doc
    ok = await client.post(
        f"/v1/encode/{F}", json={"items": [{"text": "fine"}]}, headers={"Accept": "application/json"}
    )
    assert ok.status == 200, await ok.text()


async def test_a_body_shorter_than_its_content_length_times_out(client):
    head = f"POST /v1/encode/{F} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer = await answer_to_a_short_body(client.host, client.port, head, '{"items":')
    assert answer.split(b" ")[1] == b"408", answer
