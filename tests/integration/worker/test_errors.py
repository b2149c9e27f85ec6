"""Every contract error code of ``sie serve``, and bad requests never disturbing good ones."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from protocol.codec import packb, unpackb
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

F = "sie-fake"
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def _settings(**over) -> WorkerSettings:
    base = dict(
        preload_models=F,
        machine_profile="cpu",
        max_request_body_bytes=64 * 1024,
        max_items_per_request=8,
        max_item_text_bytes=1024,
        model_loading_retry_after_s=1,
        load_failure_cooldown_s=60,
    )
    return WorkerSettings(**{**base, **over})


async def _client(settings: WorkerSettings):
    return TestClient(TestServer(create_app(Runtime(settings), settings)))


@pytest.fixture
async def client():
    async with await _client(_settings()) as c:
        yield c


@pytest.fixture
async def lone_client():
    """No model preloaded, so a faulting model has no sibling to evict."""
    async with await _client(_settings(preload_models="")) as c:
        yield c


async def post(client, path, body, headers=MSGPACK):
    resp = await client.post(path, data=packb(body) if isinstance(body, dict) else body, headers=headers)
    raw = await resp.read()
    return resp, raw


async def error(client, path, body, headers=MSGPACK):
    resp, raw = await post(client, path, body, headers)
    assert resp.content_type == "application/json", raw
    return resp.status, (await resp.json())["detail"], resp.headers


@pytest.mark.parametrize(
    ("body", "param_fragment"),
    [
        ({"items": []}, "items"),
        ({"items": [{"text": "x"}], "params": {"options": {"profile": "nope"}}}, "profile"),
        ({"items": [{"text": "x"}], "params": {"output_types": ["bogus"]}}, "output_types"),
        ({"items": [{"text": "x"}], "params": {"output_dtype": "int4"}}, "output_dtype"),
        ({"items": [{"text": "x"}], "params": {"options": {"overflow_policy": "bogus"}}}, "overflow_policy"),
        ({"items": [{"text": "x"}] * 9}, "items"),
        ({"items": [{"text": "x" * 2000}]}, "items.0.text"),
        ({"items": [{"images": [{"data": b"\xff\xd8", "format": "jpeg"}]}]}, "items.0.images"),
        ({"items": [{"text": 3}]}, "items.0.text"),
        ({"items": "not a list"}, "items"),
    ],
)
async def test_invalid_input(client, body, param_fragment):
    status, detail, headers = await error(client, f"/v1/encode/{F}", body)
    assert status == 400 and detail["code"] == "INVALID_INPUT", detail
    assert param_fragment in (detail.get("param") or detail["message"])
    assert headers["X-SIE-Error-Code"] == "INVALID_INPUT" and "Retry-After" not in headers


async def test_malformed_bodies(client):
    status, detail, _ = await error(client, f"/v1/encode/{F}", b"\xc1\xc1")
    assert (status, detail["code"]) == (400, "INVALID_INPUT")
    status, detail, _ = await error(
        client, f"/v1/encode/{F}", b"{not json", {"Content-Type": "application/json"}
    )
    assert (status, detail["code"]) == (400, "INVALID_INPUT")


async def test_unknown_model_and_operation_mismatch(client):
    status, detail, _ = await error(client, "/v1/encode/no/such-model", {"items": [{"text": "x"}]})
    assert (status, detail["code"]) == (404, "MODEL_NOT_FOUND")
    status, detail, _ = await error(
        client,
        "/v1/score/sentence-transformers/all-MiniLM-L6-v2",
        {"query": {"text": "q"}, "items": [{"text": "d"}]},
    )
    assert (status, detail["code"]) == (400, "INVALID_INPUT") and "scoring" in detail["message"]
    resp = await client.get("/v1/models/no/such-model")
    assert resp.status == 404 and (await resp.json())["detail"]["code"] == "MODEL_NOT_FOUND"


async def test_body_over_the_limit_is_413(client):
    status, detail, _ = await error(client, f"/v1/encode/{F}", {"items": [{"text": "x" * 70_000}]})
    assert (status, detail["code"]) == (413, "INPUT_TOO_LONG")


async def test_a_chunked_body_over_the_limit_is_413_whether_it_came_whole_or_in_pieces():
    """No Content-Length to refuse it by: the bytes are counted, both when the whole body is there
    before the handler runs (one write of a small request) and when it is still arriving."""
    async with await _client(_settings(max_request_body_bytes=2048)) as c:
        body = packb({"items": [{"text": "x" * 1000}] * 3})
        assert len(body) > 2048
        head = (
            f"POST /v1/encode/{F} HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        ).encode()
        pieces = [body[i : i + 500] for i in range(0, len(body), 500)]
        chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]

        async def send(writes: list[bytes]) -> bytes:
            reader, writer = await asyncio.open_connection(c.server.host, c.server.port)
            for data in writes:
                writer.write(data)
                await writer.drain()
                if len(writes) > 1:
                    await asyncio.sleep(0.01)
            answer = await reader.read()
            writer.close()
            return answer

        for writes in ([head + b"".join(chunks)], [head, *chunks]):
            answer = await send(writes)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert b"INPUT_TOO_LONG" in answer


async def test_input_too_long_with_overflow_policy_error(client):
    text = " ".join(["word"] * 40)
    options = {"max_seq_length": 16}
    ok, _ = await post(client, f"/v1/encode/{F}", {"items": [{"text": text}], "params": {"options": options}})
    assert ok.status == 200  # the default policy truncates
    body = {"items": [{"text": text}], "params": {"options": {**options, "overflow_policy": "error"}}}
    status, detail, _ = await error(client, f"/v1/encode/{F}", body)
    assert (status, detail["code"]) == (400, "INPUT_TOO_LONG")


async def test_machine_profile_must_match_the_worker(client):
    status, detail, _ = await error(
        client, f"/v1/encode/{F}", {"items": [{"text": "x"}]}, {**MSGPACK, "X-SIE-MACHINE-PROFILE": "l4"}
    )
    assert status == 400 and detail["requested_profile"] == "l4" and detail["worker_identity"] == "cpu"
    resp, _ = await post(
        client, f"/v1/encode/{F}", {"items": [{"text": "x"}]}, {**MSGPACK, "X-SIE-MACHINE-PROFILE": "CPU"}
    )
    assert resp.status == 200


async def test_loading_then_served(client):
    status, detail, headers = await error(client, f"/v1/encode/{F}:slow-load", {"items": [{"text": "x"}]})
    assert (status, detail["code"]) == (503, "MODEL_LOADING") and headers["Retry-After"] == "1"
    for _ in range(100):
        resp, raw = await post(client, f"/v1/encode/{F}:slow-load", {"items": [{"text": "x"}]})
        if resp.status == 200:
            break
        await asyncio.sleep(0.1)
    assert resp.status == 200


async def test_load_failure_is_terminal_and_not_retried(client):
    await error(client, f"/v1/encode/{F}:fail-load", {"items": [{"text": "x"}]})  # starts the load
    for _ in range(100):
        status, detail, headers = await error(client, f"/v1/encode/{F}:fail-load", {"items": [{"text": "x"}]})
        if status != 503:
            break
        await asyncio.sleep(0.05)
    assert (status, detail["code"]) == (502, "MODEL_LOAD_FAILED")
    assert "Retry-After" not in headers and detail["permanent"] is True and detail["attempts"] == 1
    models = await (await client.get("/v1/models")).json()
    (entry,) = [m for m in models["models"] if m["name"] == f"{F}:fail-load"]
    assert entry["state"] == "failed" and entry["last_error"]["code"] == "MODEL_LOAD_FAILED"
    assert entry["loaded"] is False and "injected load failure" in entry["last_error"]["message"]


async def test_oom_after_recovery_is_resource_exhausted(lone_client):
    client = lone_client
    spec = f"/v1/encode/{F}:oom-3rd"
    await error(client, spec, {"items": [{"text": "x"}]})  # starts the load
    statuses = []
    for _ in range(200):
        resp, raw = await post(client, spec, {"items": [{"text": "x"}]})
        statuses.append(resp.status)
        if resp.status == 503 and resp.headers.get("X-SIE-Error-Code") == "RESOURCE_EXHAUSTED":
            assert resp.headers["Retry-After"]
            break
        await asyncio.sleep(0.02)
    assert statuses[-1] == 503, statuses
    resp, _ = await post(client, spec, {"items": [{"text": "x"}]})
    assert resp.status == 200  # the worker stays healthy after the fault


async def test_bad_requests_never_disturb_good_ones(client):
    good = {"items": [{"id": f"i{i}", "text": f"sentence {i}"} for i in range(4)]}
    bads = [b"\xc1", packb({"items": []}), packb({"items": [{"text": "x" * 70_000}]})]

    async def one_good():
        resp, raw = await post(client, f"/v1/encode/{F}", good)
        return resp.status, unpackb(raw)

    results = await asyncio.gather(
        *[one_good() for _ in range(6)], *[post(client, f"/v1/encode/{F}", b) for b in bads * 3]
    )
    for status, body in results[:6]:
        assert status == 200 and [it["id"] for it in body["items"]] == ["i0", "i1", "i2", "i3"]
    assert all(resp.status in (400, 413) for resp, _ in results[6:])
