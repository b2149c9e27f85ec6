"""Requests, results, models, capacity, pools and lifecycle of both clients, against a real
loopback aiohttp server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sdk import PoolError, RequestError, SIEAsyncClient, SIEClient
from tests.unit.sdk.conftest import Reply

MODEL = "BAAI/bge-m3"


# --------------------------------------------------------------------------- requests


def test_encode_request_path_headers_and_body(server, make_client):
    client = make_client(api_key="tok-1", options={"normalize": True, "pooling": "mean"})
    client.encode(
        MODEL,
        {"text": "hi", "id": "a"},
        output_types=["dense"],
        instruction="q",
        output_dtype="float32",
        is_query=True,
        options={"pooling": "cls"},
    )
    (seen,) = server.calls("/v1/encode/")
    assert seen.path == "/v1/encode/BAAI/bge-m3"  # model id inserted as is
    assert seen.headers["Content-Type"] == "application/msgpack"
    assert seen.headers["Accept"] == "application/msgpack"
    assert seen.headers["Authorization"] == "Bearer tok-1"
    assert seen.headers["X-SIE-SDK-Version"] == "0.10.1"
    assert "X-SIE-Pool" not in seen.headers and "X-SIE-MACHINE-PROFILE" not in seen.headers
    assert seen.body == {
        "items": [{"text": "hi", "id": "a"}],
        "params": {
            "output_types": ["dense"],
            "instruction": "q",
            "output_dtype": "float32",
            "options": {"normalize": True, "pooling": "cls", "is_query": True},
        },
    }


def test_encode_without_params_sends_items_only(server, make_client):
    client = make_client()
    client.encode(MODEL, {"text": "hi"})
    assert server.calls("/v1/encode/")[0].body == {"items": [{"text": "hi"}]}


@pytest.mark.parametrize(
    ("gpu", "pool", "profile"),
    [("l4", None, "l4"), ("eval/l4-spot", "eval", "l4-spot"), ("eval/", "eval", None)],
)
def test_gpu_routing_headers(server, make_client, gpu, pool, profile):
    client = make_client()
    client.encode(MODEL, {"text": "x"}, gpu=gpu)
    client.score(MODEL, {"text": "q"}, [{"text": "x"}], gpu=gpu)
    client.extract(MODEL, {"text": "x"}, gpu=gpu)
    for seen in server.calls("/v1/"):
        assert seen.headers.get("X-SIE-Pool") == pool
        assert seen.headers.get("X-SIE-MACHINE-PROFILE") == profile


def test_client_default_gpu_and_call_override(server, make_client):
    client = make_client(gpu="a100")
    client.encode(MODEL, {"text": "x"})
    client.encode(MODEL, {"text": "x"}, gpu="p/l4")
    first, second = server.calls("/v1/encode/")
    assert first.headers["X-SIE-MACHINE-PROFILE"] == "a100"
    assert (second.headers["X-SIE-Pool"], second.headers["X-SIE-MACHINE-PROFILE"]) == ("p", "l4")


def test_priority_class_per_client_and_per_call(server, make_client):
    client = make_client(priority="bulk")
    client.encode(MODEL, {"text": "x"})
    client.score(MODEL, {"text": "q"}, [{"text": "x"}], priority="interactive")
    client.extract(MODEL, {"text": "x"})
    assert [c.headers.get("X-SIE-Priority") for c in server.calls("/v1/")] == ["bulk", "interactive", "bulk"]
    plain = make_client()
    plain.encode(MODEL, {"text": "x"})
    assert "X-SIE-Priority" not in server.calls("/v1/")[-1].headers  # the server's default applies
    with pytest.raises(ValueError, match="priority"):
        plain.encode(MODEL, {"text": "x"}, priority="urgent")
    with pytest.raises(ValueError, match="priority"):
        make_client(priority="high")


def test_api_key_from_environment_and_explicit_empty(server, make_client, monkeypatch):
    monkeypatch.setenv("SIE_API_KEY", "env-key")
    monkeypatch.delenv("SIE_BASE_URL", raising=False)
    make_client().encode(MODEL, {"text": "x"})
    make_client(api_key="").encode(MODEL, {"text": "x"})
    monkeypatch.setenv("SIE_BASE_URL", "http://other-host:9999")
    make_client().encode(MODEL, {"text": "x"})  # key is scoped to SIE_BASE_URL's origin
    monkeypatch.setenv("SIE_BASE_URL", server.url)
    make_client(base_url=None).encode(MODEL, {"text": "x"})
    auth = [s.headers.get("Authorization") for s in server.calls("/v1/encode/")]
    assert auth == ["Bearer env-key", None, None, "Bearer env-key"]


def test_invalid_base_url_is_refused():
    with pytest.raises(ValueError):
        SIEClient("localhost:8080")
    with pytest.raises(ValueError):
        SIEAsyncClient("ftp://host")


# --------------------------------------------------------------------------- results


def test_encode_results_carry_arrays_timing_and_request_metadata(server, make_client):
    client = make_client()
    results = client.encode(
        MODEL,
        [{"id": "a", "text": "xy"}, {"id": "b", "text": "xyz"}, {"text": "z"}],
        output_types=["dense", "sparse", "multivector"],
    )
    assert isinstance(results, list) and len(results) == 3
    a, b, c = results
    assert (a["id"], b["id"]) == ("a", "b") and "id" not in c
    assert a["dense"].dtype == np.float32 and a["dense"].tolist() == [2.0, 0.0, 1.0, 2.0]
    assert b["dense"].tolist() == [3.0, 1.0, 1.0, 2.0]
    assert a["sparse"]["indices"].dtype == np.int32 and a["sparse"]["indices"].tolist() == [3, 7, 42]
    assert a["sparse"]["values"].tolist() == [0.5, 0.25, 0.125]
    assert a["multivector"].shape == (3, 2)
    assert a["model"] == MODEL
    assert a["timing"] == {"total_ms": 1.5, "inference_ms": 1.0}
    assert a["request"]["id"].startswith("req-")
    assert a["request"]["usage"] == {"input_tokens": 7}


def test_single_item_returns_a_dict(server, make_client):
    result = make_client().encode(MODEL, {"text": "hello"})
    assert isinstance(result, dict) and result["dense"].shape == (4,)


def test_score_result_shape(server, make_client):
    result = make_client().score(
        MODEL,
        {"text": "q", "id": "q1"},
        [{"id": "d1", "text": "a"}, {"id": "d2", "text": "longer"}],
        instruction="i",
    )
    assert result["model"] == MODEL
    assert result["query_id"] == "q1"
    assert [(s["item_id"], s["rank"]) for s in result["scores"]] == [("d2", 0), ("d1", 1)]
    assert result["request"]["id"].startswith("req-")
    (seen,) = server.calls("/v1/score/")
    assert seen.body["instruction"] == "i" and seen.body["query"] == {"text": "q", "id": "q1"}


def test_extract_result_shape(server, make_client):
    results = make_client().extract(
        "urchade/gliner",
        [{"text": "Ada wrote"}, {"text": "Bob ran"}],
        labels=["person"],
        output_schema={"a": 1},
    )
    assert [r["id"] for r in results] == ["item-0", "item-1"]
    assert results[1]["entities"][0] == {
        "text": "Bob",
        "label": "person",
        "score": 0.9,
        "start": 0,
        "end": 3,
        "bbox": None,
    }
    assert results[0]["relations"] == [] and results[0]["objects"] == [] and "data" not in results[0]
    (seen,) = server.calls("/v1/extract/")
    assert seen.body["params"] == {"labels": ["person"], "output_schema": {"a": 1}}


def test_extract_item_error_is_normalised(server, make_client):
    server.script("extract", Reply(msgpack={"model": "m", "items": [{"id": "x", "error": {"code": ""}}]}))
    (result,) = make_client().extract("m", [{"text": "x"}])
    assert result["error"] == {"code": "INTERNAL_ERROR", "message": "Malformed extraction item error"}


# --------------------------------------------------------------------------- models and capacity


def test_list_and_get_models(server, make_client):
    client = make_client()
    models = client.list_models()
    assert models[0]["dims"]["dense"] == 4
    assert client.get_model("test/dense")["name"] == "test/dense"
    with pytest.raises(RequestError) as info:
        client.get_model("no/such-model")
    assert (info.value.status_code, info.value.code) == (404, "MODEL_NOT_FOUND")
    assert all(s.headers["Accept"] == "application/json" for s in server.calls("/v1/models"))


def test_get_capacity_from_a_gateway(server, make_client):
    server.health = {
        "type": "gateway",
        "status": "healthy",
        "cluster": {"worker_count": 3, "gpu_count": 3},
        "configured_gpu_types": ["l4", "a100"],
        "live_gpu_types": ["l4"],
        "workers": [{"name": "w1", "gpu": "L4", "healthy": True}, {"name": "w2", "gpu": "a100"}],
    }
    client = make_client()
    capacity = client.get_capacity()
    assert capacity["worker_count"] == 3 and capacity["configured_gpu_types"] == ["l4", "a100"]
    l4 = client.get_capacity(gpu="l4")
    assert (
        l4["worker_count"] == 1
        and l4["workers"][0]["name"] == "w1"
        and l4["workers"][0]["ready_gpu_slots"] == 1
    )


def test_get_capacity_against_a_worker(server, make_client):
    client = make_client()
    with pytest.raises(RequestError) as info:
        client.get_capacity()
    assert info.value.status_code == 404
    server.health = {"status": "ok"}
    with pytest.raises(RequestError) as info:
        client.get_capacity()
    assert info.value.code == "not_gateway"


# --------------------------------------------------------------------------- pools


def on_the_wire(make_client, pools: int) -> int:
    """Renewals that may reach the server after the client stopped renewing: none from the sync
    client (stopping joins the renewal thread, so a request it had sent got its answer first);
    one per pool from the async one, whose stop cancels the renewal task, which does not unsend a
    request it had written. The server thread records a request when it gets to read it, which on
    a busy machine is after the test has counted."""
    return 0 if make_client.kind == "sync" else pools


def test_pool_writes_carry_the_admin_key_and_the_rest_the_api_key(server, make_client):
    client = make_client(api_key="inference-key", admin_key="pool-admin-key", lease_renewal_interval_s=0.05)
    client.create_pool("p")
    client.sleep(0.3)
    client.get_pool("p")
    client.delete_pool("p")
    client.encode("m", {"text": "x"})
    auth = {(c.method, c.path.split("/")[-1]): c.headers.get("Authorization") for c in server.calls()}
    assert auth[("POST", "pools")] == "Bearer pool-admin-key"
    assert auth[("POST", "renew")] == "Bearer pool-admin-key"
    assert auth[("DELETE", "p")] == "Bearer pool-admin-key"
    assert auth[("GET", "p")] == "Bearer inference-key"  # a read: the API key
    assert auth[("POST", "m")] == "Bearer inference-key"
    # without an admin key, pool writes go with the API key (as the public SDK sends them)
    plain = make_client(api_key="only-key")
    plain.create_pool("q")
    (create,) = server.calls("/v1/pools", "POST")[-1:]
    assert create.headers["Authorization"] == "Bearer only-key"


def test_pool_lifecycle_and_lease_renewal(server, make_client):
    client = make_client(lease_renewal_interval_s=0.05)
    client.create_pool("Eval-1", {"l4": 1}, minimum_worker_count=0, pinned_models=["m"])
    (create,) = server.calls("/v1/pools", "POST")
    assert create.body == {
        "name": "Eval-1",
        "gpus": {"l4": 1},
        "minimum_worker_count": 0,
        "pinned_models": ["m"],
    }
    assert create.headers["Content-Type"] == "application/json"
    client.sleep(0.5)
    renewals = server.calls("/v1/pools/Eval-1/renew", "POST")
    assert len(renewals) >= 3  # the caller's spelling, every interval
    pool = client.get_pool("eval-1")
    assert (
        pool["name"] == "eval-1"
        and pool["status"]["state"] == "pending"
        and pool["spec"]["gpus"] == {"l4": 1}
    )
    assert client.delete_pool("Eval-1") is True
    count = len(server.calls("/v1/pools/Eval-1/renew"))
    client.sleep(0.3)
    # renewal stopped with the delete (a renewer left running would add about 6 here)
    assert len(server.calls("/v1/pools/Eval-1/renew")) <= count + on_the_wire(make_client, pools=1)
    assert client.delete_pool("Eval-1") is False
    assert client.get_pool("eval-1") is None


def test_close_stops_lease_renewal(server, make_client):
    client = make_client(lease_renewal_interval_s=0.05)
    client.create_pool("p1")
    client.create_pool("p2", {"l4": 1})
    client.sleep(0.3)
    assert server.calls("/v1/pools/p1/renew") and server.calls("/v1/pools/p2/renew")
    client.close()
    count = len(server.calls("/v1/pools/"))
    asyncio.run(asyncio.sleep(0.3))
    # renewing every 0.05 s, a renewer left running would add about 6 per pool here
    assert len(server.calls("/v1/pools/")) <= count + on_the_wire(make_client, pools=2)


def test_failed_renewal_is_retried_before_the_next_cycle(server, make_client):
    client = make_client(lease_renewal_interval_s=1.0)
    server.script(
        "renew", Reply(status=500, json={"detail": "boom"}), Reply(status=404, json={"detail": "gone"})
    )
    client.create_pool("p")
    client.sleep(
        1.6
    )  # cycle at 1.0 s fails twice, the backoff retry follows within ~0.05 s; next cycle at 2.0 s
    assert len(server.calls("/v1/pools/p/renew")) == 3
    client.close()


def test_pool_errors(server, make_client):
    client = make_client()
    server.script("pools", Reply(status=400, json={"detail": {"message": "unknown machine profile 'x'"}}))
    with pytest.raises(PoolError, match="unknown machine profile") as info:
        client.create_pool("x", {"not-a-profile": 1})
    assert info.value.status_code == 400 and info.value.pool_name == "x"
    server.script("pools", Reply(status=403, json={"detail": {"message": "default pool cannot be deleted"}}))
    with pytest.raises(PoolError):
        client.delete_pool("default")
    with pytest.raises(ValueError):
        client.create_pool("y", minimum_worker_count=-1)


def test_class_level_renewal_interval(server):
    class Quick(SIEClient):
        lease_renewal_interval_s = 0.05

    with Quick(server.url) as client:
        client.create_pool("q")
        asyncio.run(asyncio.sleep(0.3))
    assert len(server.calls("/v1/pools/q/renew")) >= 2


# --------------------------------------------------------------------------- lifecycle


def test_connections_are_reused(server, make_client):
    client = make_client()
    for _ in range(4):
        client.encode(MODEL, {"text": "x"})
    peers = {s.peer for s in server.calls("/v1/encode/")}
    assert len(peers) == 1


def test_sync_context_manager_closes(server):
    with SIEClient(server.url) as client:
        client.encode(MODEL, {"text": "x"})
    with pytest.raises(RuntimeError):
        client.encode(MODEL, {"text": "x"})


async def test_async_context_manager_and_concurrency(server):
    async with SIEAsyncClient(server.url, lease_renewal_interval_s=0.05) as client:
        results = await asyncio.gather(*(client.encode(MODEL, {"text": "x" * n}) for n in range(1, 6)))
        assert [r["dense"][0] for r in results] == [1, 2, 3, 4, 5]
        await client.create_pool("a")
        await asyncio.sleep(0.3)
    assert server.calls("/v1/pools/a/renew")
    count = len(server.calls("/v1/pools/a/renew"))
    await asyncio.sleep(0.2)
    assert len(server.calls("/v1/pools/a/renew")) <= count + 1  # + the one close() may have cut off
    with pytest.raises(RuntimeError):
        await client.encode(MODEL, {"text": "x"})


def test_async_client_survives_successive_event_loops(server):
    client = SIEAsyncClient(server.url)
    first = asyncio.run(client.encode(MODEL, {"text": "ab"}))
    second = asyncio.run(client.encode(MODEL, {"text": "abc"}))
    assert (first["dense"][0], second["dense"][0]) == (2.0, 3.0)
    asyncio.run(client.close())
