"""``sie serve``'s opt-in result cache (issue 17): the gateway's key function, an in-process LRU.

"No work" is read from the runtime's own forward-pass counter."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from protocol.codec import packb, unpackb
from protocol.model_config import parse_model_yaml
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.serve.result_cache import ResultLRU
from worker.settings import WorkerSettings

F = "sie-fake"
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


@pytest.fixture
async def served():
    settings = WorkerSettings(preload_models=F, machine_profile="cpu", serve_result_cache_items=100)
    runtime = Runtime(settings)
    async with TestClient(TestServer(create_app(runtime, settings))) as client:
        yield client, runtime


async def encode(client, texts, headers=None, **params):
    body = {"items": [{"text": t} for t in texts], "params": {"output_types": ["dense"], **params}}
    resp = await client.post(f"/v1/encode/{F}", data=packb(body), headers={**MSGPACK, **(headers or {})})
    raw = await resp.read()
    return resp, (await resp.json()) if resp.content_type == "application/json" else unpackb(raw)


def dense(body) -> list[np.ndarray]:
    return [np.asarray(item["dense"]["values"]) for item in body["items"]]


async def test_hits_skip_the_model_and_equal_fresh_results(served):
    client, runtime = served
    resp, first = await encode(client, ["one", "two"])
    assert resp.status == 200 and resp.headers["X-SIE-Cache-Hits"] == "0"
    forwards = runtime.batch_stats().forwards
    resp, again = await encode(client, ["one", "two"])
    assert resp.headers["X-SIE-Cache-Hits"] == "2"
    assert runtime.batch_stats().forwards == forwards
    for a, b in zip(dense(first), dense(again), strict=True):
        assert np.array_equal(a, b)
    # per item: one hit, one computed, in request order
    resp, mixed = await encode(client, ["three", "two"])
    assert resp.headers["X-SIE-Cache-Hits"] == "1" and runtime.batch_stats().forwards > forwards
    assert np.array_equal(dense(mixed)[1], dense(first)[1])
    assert not np.array_equal(dense(mixed)[0], dense(first)[1])
    # the params are part of the key
    resp, _ = await encode(client, ["one"], output_dtype="int8")
    assert resp.headers["X-SIE-Cache-Hits"] == "0"
    metrics = await (await client.get("/metrics")).text()
    assert 'sie_worker_result_cache_lookups_total{result="hit"} 3.0' in metrics


async def test_opt_out_and_a_bad_header(served):
    client, runtime = served
    await encode(client, ["opt out"])
    forwards = runtime.batch_stats().forwards
    resp, _ = await encode(client, ["opt out"], {"X-SIE-Cache": "off"})
    assert resp.headers["X-SIE-Cache-Hits"] == "0" and runtime.batch_stats().forwards > forwards
    resp, body = await encode(client, ["x"], {"X-SIE-Cache": "sometimes"})
    assert resp.status == 400 and body["detail"]["code"] == "INVALID_INPUT"


async def test_an_item_error_names_its_index_in_the_whole_request(served):
    client, _ = served
    await encode(client, ["fine"])
    body = {"items": [{"text": "fine"}, {"text": 5}], "params": {"output_types": ["dense"]}}
    resp = await client.post(f"/v1/encode/{F}", data=packb(body), headers=MSGPACK)
    detail = (await resp.json())["detail"]
    assert resp.status == 400 and "items.1" in str(detail), detail


async def test_a_changed_model_config_misses(served):
    client, runtime = served
    await encode(client, ["config bound"])
    config = runtime.catalog.get(F)
    data = config.model_dump(mode="json", exclude_none=True)
    data["profiles"]["extra"] = {"extends": "default"}
    runtime.catalog.put(parse_model_yaml(yaml.safe_dump(data)))
    forwards = runtime.batch_stats().forwards
    resp, _ = await encode(client, ["config bound"])
    assert resp.headers["X-SIE-Cache-Hits"] == "0" and runtime.batch_stats().forwards > forwards


def test_the_lru_is_bounded_and_entries_expire():
    now = [0.0]
    lru = ResultLRU(max_items=2, ttl_s=10.0, clock=lambda: now[0])
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert len(lru) == 2 and lru.get("b") is None and lru.get("c") == 3
    now[0] = 10.5
    assert lru.get("a") is None and lru.get("c") is None and len(lru) == 0
