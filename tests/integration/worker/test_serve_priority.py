"""Priority classes on ``sie serve``: ``X-SIE-Priority`` (else ``SIE_SERVE_DEFAULT_PRIORITY``) picks the
class a request's items queue in; interactive work overtakes a bulk backlog; a bad value is a 400."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from protocol.codec import packb, unpackb
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

SLOW = "sie-fake:slow-batch"  # every forward pass sleeps 300 ms
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def _settings(**over) -> WorkerSettings:
    base = dict(
        preload_models=SLOW, max_batch_requests=8, serve_bulk_mixed_batch_requests=4, max_items_per_request=64
    )
    return WorkerSettings(**{**base, **over})


async def _encode(client, texts, headers=None):
    resp = await client.post(
        f"/v1/encode/{SLOW}",
        data=packb({"items": [{"text": t} for t in texts]}),
        headers={**MSGPACK, **(headers or {})},
    )
    assert resp.status == 200, await resp.text()
    return unpackb(await resp.read())


@pytest.mark.parametrize(
    ("default", "bulk_headers", "interactive_headers"),
    [
        ("interactive", {"X-SIE-Priority": "bulk"}, {}),  # the header picks bulk
        ("bulk", {}, {"X-SIE-Priority": "Interactive"}),  # the setting makes bulk the default
    ],
)
async def test_interactive_is_answered_while_a_bulk_backlog_is_worked_through(
    default, bulk_headers, interactive_headers
):
    settings = _settings(serve_default_priority=default)
    runtime = Runtime(settings)
    async with TestClient(TestServer(create_app(runtime, settings))) as client:
        await _encode(client, ["warm"], interactive_headers)  # the model is loaded and has run once
        bulk = [
            asyncio.create_task(_encode(client, [f"bulk {r} {i}" for i in range(8)], bulk_headers))
            for r in range(4)
        ]  # 32 items: at least 4 forward passes of 300 ms whatever the order
        # the backlog is queued: at least 16 of its 32 items wait (on a slow machine a batch of 8 may
        # have run and another be running before the last request is tokenised)
        while runtime.queue_depth() < 16:
            await asyncio.sleep(0.01)
        # a longer text than the bulk ones: it cannot ride along in a bulk-sized batch by cost
        answer = await _encode(client, ["an interactive text " * 8], interactive_headers)
        assert len(answer["items"]) == 1
        # first come, first served would have answered all four bulk requests first; the interactive
        # text waited for at most the bulk batch on the worker
        assert sum(t.done() for t in bulk) <= 2
        assert runtime.queue_depth() > 0
        done = await asyncio.gather(*bulk)
        assert [len(d["items"]) for d in done] == [8] * 4


async def _error(client, path, body, headers):
    resp = await client.post(path, data=packb(body), headers={**MSGPACK, **headers})
    return resp.status, await resp.json(), resp.headers


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/encode/sie-fake", {"items": [{"text": "x"}]}),
        ("/v1/score/sie-fake", {"query": {"text": "q"}, "items": [{"text": "d"}]}),
        ("/v1/extract/sie-fake", {"items": [{"text": "x"}]}),
        ("/v1/tokenize/sie-fake", {"items": [{"text": "x"}]}),
    ],
)
async def test_an_unknown_priority_is_a_400_invalid_input(path, body):
    settings = WorkerSettings(preload_models="sie-fake")
    async with TestClient(TestServer(create_app(Runtime(settings), settings))) as client:
        status, payload, headers = await _error(client, path, body, {"X-SIE-Priority": "urgent"})
        assert status == 400 and headers["X-SIE-Error-Code"] == "INVALID_INPUT", payload
        assert payload["detail"]["code"] == "INVALID_INPUT" and payload["detail"]["param"] == "X-SIE-Priority"
        # the same request with a known class passes the check (sie-fake exposes no tokenizer, so
        # tokenize still fails, for that reason)
        status, payload, _ = await _error(
            client, path, body, {"X-SIE-Priority": "bulk", "Accept": "application/json"}
        )
        assert (status, payload.get("detail", {}).get("param")) == (
            (400, "model") if "tokenize" in path else (200, None)
        )


async def test_an_unknown_priority_on_the_openai_route_is_an_openai_400():
    settings = WorkerSettings(preload_models="sie-fake")
    async with TestClient(TestServer(create_app(Runtime(settings), settings))) as client:
        resp = await client.post(
            "/v1/embeddings", json={"model": "sie-fake", "input": "x"}, headers={"X-SIE-Priority": "urgent"}
        )
        body = await resp.json()
        assert resp.status == 400 and body["error"]["param"] == "X-SIE-Priority", body
        resp = await client.post(
            "/v1/embeddings", json={"model": "sie-fake", "input": "x"}, headers={"X-SIE-Priority": "bulk"}
        )
        assert resp.status == 200, await resp.text()


def test_the_default_priority_setting_is_checked():
    assert WorkerSettings(serve_default_priority=" BULK ").serve_default_priority == "bulk"
    with pytest.raises(ValidationError, match="SIE_SERVE_DEFAULT_PRIORITY"):
        WorkerSettings(serve_default_priority="urgent")
