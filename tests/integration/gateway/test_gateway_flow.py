"""The gateway against a real nats-server and a test-side lane peer (FakeWorker)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from protocol.codec import packb, unpackb
from protocol.work import WorkResult
from protocol.work_codec import MSG_ID, WorkCodec
from tests.integration.gateway.conftest import DENSE, EXTRACT, RERANK
from tests.integration.gateway.fake_worker import FakeWorker, answer, fake_vector
from tests.support.polling import wait_until

MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
SDK = {**MSGPACK, "X-SIE-SDK-Version": "0.10.1"}


async def wait_workers(h, n: int = 1) -> None:
    await wait_until(lambda: len(h.gateway.workers.healthy()) >= n, what=f"{n} workers registered")


async def post(h, path: str, body, headers=None):
    async with h.session.post(h.url(path), data=packb(body), headers=headers or SDK) as resp:
        raw = await resp.read()
        ctype = resp.headers.get("Content-Type", "")
        parsed = unpackb(raw) if "msgpack" in ctype else (json.loads(raw) if raw else None)
        return resp.status, dict(resp.headers), parsed


async def test_encode_roundtrip_msgpack_and_json(nats_server, start_gateway):
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        items = [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}, {"text": "z"}]
        status, headers, body = await post(h, f"/v1/encode/{DENSE}", {"items": items})
        assert status == 200, body
        assert body["model"] == DENSE
        assert [it.get("id") for it in body["items"]] == ["a", "b", None]
        for it, src in zip(body["items"], items, strict=True):
            assert isinstance(it["dense"]["values"], np.ndarray)
            np.testing.assert_array_equal(it["dense"]["values"], fake_vector(src["text"]))
        assert headers["X-SIE-Server-Version"].startswith("0.10")
        assert headers["X-SIE-Request-ID"]
        assert headers["X-SIE-Units-Input-Tokens"] == "9"
        # the work item carried the routing and request fields
        job = w.seen[0].job
        assert job.model_id == DENSE and job.pool_name == "default" and job.machine_profile == "cpu"
        assert job.reply_subject.startswith(f"_INBOX.{h.gateway.router_id}.")
        assert job.deadline and job.bundle == "default"
        # the request's group key, derived once: the same on each of its items
        assert job.batch_key and {wi.job.batch_key for wi in w.seen[:3]} == {job.batch_key}
        # the three items went in one message, which says how many of the request's items were
        # published, for the sidecar to batch them together
        (chunk,) = {hdr[MSG_ID]: hdr for hdr in w.seen_headers[:3]}.values()
        assert {r.request_items for r in WorkCodec.routes(chunk)} == {3}
        assert [r.item_index for r in WorkCodec.routes(chunk)] == [0, 1, 2]

        async with h.session.post(
            h.url(f"/v1/encode/{DENSE}"),
            json={"items": [{"text": "x"}], "params": {"options": {"is_query": True}, "instruction": "q"}},
            headers={"Accept": "application/json"},
        ) as resp:
            assert resp.status == 200
            data = await resp.json()
        assert data["items"][0]["dense"]["values"] == pytest.approx(fake_vector("x").tolist())
        assert w.seen[-1].job.params.is_query is True and w.seen[-1].job.params.instruction == "q"
        assert w.seen[-1].job.batch_key != job.batch_key  # other parameters, another group
    finally:
        await w.stop()


async def test_items_are_counted_for_the_sidecar_only_when_one_pod_pulls_the_lane(nats_server, start_gateway):
    """JetStream hands a lane's messages round the pods' pull requests one by one: with two pods a
    request's items go in two messages of half each, so both pods work on it, and each message
    counts only its own items (no pod waits for the rest)."""
    h = await start_gateway()
    workers = [await FakeWorker(nats_server.url, name).start() for name in ("w1", "w2")]
    try:
        await wait_workers(h, 2)
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": t} for t in "abcd"]})
        assert status == 200, body
        messages = {hdr[MSG_ID]: hdr for w in workers for hdr in w.seen_headers}.values()
        assert sorted([r.item_index for r in WorkCodec.routes(hdr)] for hdr in messages) == [[0, 1], [2, 3]]
        assert [WorkCodec.routes(hdr)[0].request_items for hdr in messages] == [2, 2]
    finally:
        for w in workers:
            await w.stop()


async def test_a_chunk_carries_its_job_once(nats_server, start_gateway):
    """A message of several items carries their job (what the request's items share) once, and
    each item's input on its own."""
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        items = [{"text": t} for t in ("one", "two", "three")]
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": items})
        assert status == 200, body
        for it, src in zip(body["items"], items, strict=True):
            np.testing.assert_array_equal(it["dense"]["values"], fake_vector(src["text"]))
        (chunk,) = w.seen_bodies
        job, inputs = unpackb(chunk)
        assert unpackb(job)["model_id"] == DENSE
        assert [unpackb(own) for own in inputs] == [{"i": i, "item": src} for i, src in enumerate(items)]
        assert [wi.work_item_id for wi in w.seen] == [f"{w.seen[0].request_id}.{i}" for i in range(3)]
        assert len({id(wi.job) for wi in w.seen}) == 1 and w.seen[0].job.reply_subject.startswith("_INBOX.")
    finally:
        await w.stop()


async def test_score_and_extract_pass_through(nats_server, start_gateway):
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        status, _, body = await post(
            h,
            f"/v1/score/{RERANK}",
            {
                "query": {"id": "q", "text": "machine learning"},
                "items": [{"id": "d1", "text": "snake"}, {"id": "d2", "text": "machine learning field"}],
            },  # fmt: skip
        )
        assert status == 200, body
        assert body["model"] == RERANK and body["query_id"] == "q"
        assert [s["item_id"] for s in body["scores"]] == ["d2", "d1"]
        assert [s["rank"] for s in body["scores"]] == [0, 1]

        status, _, body = await post(
            h,
            f"/v1/extract/{EXTRACT}",
            {
                "items": [{"text": "Apple hired Steve"}, {"text": "nothing"}],
                "params": {"labels": ["org"]},
            },  # fmt: skip
        )
        assert status == 200, body
        assert len(body["items"]) == 2
        assert body["items"][0]["id"] == "item-0"
        assert {e["text"] for e in body["items"][0]["entities"]} == {"Apple", "Steve"}

        # a model without the task is a clear 400
        status, headers, body = await post(
            h, f"/v1/score/{DENSE}", {"query": {"text": "a"}, "items": [{"text": "b"}]}
        )
        assert status == 400 and body["detail"]["code"] == "INVALID_INPUT"
    finally:
        await w.stop()


async def test_equal_items_of_a_request_are_computed_once(nats_server, start_gateway):
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        items = [{"text": "same"}] * 100 + [{"text": "other"}, {"id": "a", "text": "same"}]
        status, headers, body = await post(h, f"/v1/encode/{DENSE}", {"items": items})
        assert status == 200, body
        # one work item per distinct input: the plain one, the other text, the one with its own id
        assert sorted(wi.item_index for wi in w.seen) == [0, 100, 101]
        assert len(body["items"]) == 102
        for it, src in zip(body["items"], items, strict=True):
            np.testing.assert_array_equal(it["dense"]["values"], fake_vector(src["text"]))
            assert it.get("id") == src.get("id")
        assert headers["X-SIE-Units-Input-Tokens"] == str(3 * 102)  # each item counts, as if computed

        # an extract answer names its item; an equal one without an id gets its own item-<index>
        w.seen.clear()
        extract = [{"text": "Apple hired Steve"}, {"text": "nothing"}, {"text": "Apple hired Steve"}]
        status, _, body = await post(
            h, f"/v1/extract/{EXTRACT}", {"items": extract, "params": {"labels": ["org"]}}
        )
        assert status == 200, body
        assert len(w.seen) == 2
        assert [it["id"] for it in body["items"]] == ["item-0", "item-1", "item-2"]
        assert body["items"][2]["entities"] == body["items"][0]["entities"]
    finally:
        await w.stop()


async def test_scale_from_zero_answers_and_records_demand(start_gateway):
    h = await start_gateway()
    body = {"items": [{"text": "hi"}]}
    # modern SDK: 503 PROVISIONING
    status, headers, data = await post(h, f"/v1/encode/{DENSE}", body, {**SDK, "X-SIE-MACHINE-PROFILE": "l4"})
    assert status == 503
    assert headers["X-SIE-Error-Code"] == "PROVISIONING" and float(headers["Retry-After"]) > 0
    assert data["detail"]["code"] == "PROVISIONING"
    # a client without the SDK header: 202 + provisioning body
    status, headers, data = await post(h, f"/v1/encode/{DENSE}", body, MSGPACK)
    assert status == 202 and data["status"] == "provisioning" and "Retry-After" in headers
    # an old SDK
    status, _, _ = await post(h, f"/v1/encode/{DENSE}", body, {**MSGPACK, "X-SIE-SDK-Version": "0.6.2"})
    assert status == 202
    # OpenAI route: always 503
    async with h.session.post(h.url("/v1/embeddings"), json={"model": DENSE, "input": "hi"}) as resp:
        assert resp.status == 503 and resp.headers["X-SIE-Error-Code"] == "PROVISIONING"
        assert "Retry-After" in resp.headers
    async with h.session.get(h.url("/metrics")) as resp:
        text = await resp.text()
    assert 'sie_gateway_pending_demand{bundle="default",machine_profile="l4"} 1.0' in text
    # an unconfigured profile is a clear 400 naming the configured ones
    status, _, data = await post(h, f"/v1/encode/{DENSE}", body, {**SDK, "X-SIE-MACHINE-PROFILE": "h100"})
    assert status == 400 and "cpu" in data["detail"]["message"]


async def test_profile_routing_and_capacity_arrival(nats_server, start_gateway):
    h = await start_gateway(gateway_worker_stale_s=3600)  # only the tombstone can remove a worker
    cpu = await FakeWorker(nats_server.url, "cpu-1", profile="cpu").start()
    try:
        await wait_workers(h)
        hdr = {**SDK, "X-SIE-MACHINE-PROFILE": "l4"}
        status, _, _ = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, hdr)
        assert status == 503  # no l4 worker: no silent fallback to cpu
        l4 = await FakeWorker(nats_server.url, "l4-1", profile="l4").start()
        try:
            await wait_workers(h, 2)
            status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, hdr)
            assert status == 200, body
            assert l4.seen and l4.seen[-1].job.machine_profile == "l4" and not cpu.seen
        finally:
            await l4.stop()
        # the tombstone removes the worker (it would be stale only in an hour)
        await wait_until(lambda: len(h.gateway.workers.healthy()) == 1, what="the l4 worker removed")
        status, _, _ = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, hdr)
        assert status == 503
    finally:
        await cpu.stop()


async def test_stale_worker_is_not_routed(nats_server, start_gateway):
    h = await start_gateway(gateway_worker_stale_s=1.0)
    w = await FakeWorker(nats_server.url, "w1", heartbeat_s=60).start()
    try:
        await wait_workers(h)
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]})
        assert status == 200, body  # the lane chosen here is not kept past the worker's staleness
        await wait_until(lambda: not h.gateway.workers.healthy(), what="the silent worker stale")
        status, headers, _ = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]})
        assert status == 503 and headers["X-SIE-Error-Code"] == "PROVISIONING"
    finally:
        await w.stop()


async def test_a_gateway_asks_for_the_heartbeats_when_it_starts_and_reconnects(nats_server, start_gateway):
    """A worker that beats once a minute is known to a gateway started after its last beat at once
    (the gateway asks every sidecar for its heartbeat), and again after a reconnect found it stale;
    without asking, the gateway would answer PROVISIONING (Retry-After 10 s) until the next beat."""
    w = await FakeWorker(nats_server.url, "w1", heartbeat_s=60).start()  # its first beat: before the gateway
    try:
        h = await start_gateway(gateway_worker_stale_s=1.0)
        assert await h.gateway.heartbeats.hear_workers(10.0) == 1
        status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]})
        assert status == 200, body
        await wait_until(lambda: not h.gateway.workers.healthy(), what="the silent worker stale")
        h.gateway.on_reconnect()  # what the NATS client's reconnected callback calls (gateway/main.py)
        await wait_workers(h)
    finally:
        await w.stop()


async def test_deadline_gives_504_and_cancels_work(nats_server, start_gateway):
    async def never(item, worker):
        return None

    h = await start_gateway(gateway_request_timeout_s=1.0)
    w = await FakeWorker(nats_server.url, "w1", handler=never).start()
    cancels = []

    async def on_cancel(m):
        cancels.append(m.subject)

    sub = await h.nc.subscribe("work_cancel.>", cb=on_cancel)
    try:
        await wait_workers(h)
        status, headers, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]})
        assert status == 504
        assert (
            body["detail"]["code"] == "GATEWAY_TIMEOUT" and headers["X-SIE-Error-Code"] == "GATEWAY_TIMEOUT"
        )
        rid = headers["X-SIE-Request-ID"]
        await wait_until(lambda: f"work_cancel.{h.gateway.router_id}.{rid}" in cancels, what="the cancel")
    finally:
        await sub.unsubscribe()
        await w.stop()


async def test_client_disconnect_cancels_work(nats_server, start_gateway):
    async def never(item, worker):
        return None

    h = await start_gateway(gateway_request_timeout_s=30.0)
    w = await FakeWorker(nats_server.url, "w1", handler=never).start()
    cancels = []

    async def on_cancel(m):
        cancels.append(m.subject)

    sub = await h.nc.subscribe("work_cancel.>", cb=on_cancel)
    try:
        await wait_workers(h)
        task = asyncio.create_task(post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}))
        await wait_until(lambda: w.seen, what="the item at the worker")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: cancels, what="the cancel")
        assert cancels == [f"work_cancel.{h.gateway.router_id}.{w.seen[0].request_id}"]
        assert h.gateway.dispatcher.pending_requests == 0
    finally:
        await sub.unsubscribe()
        await w.stop()


async def test_queue_full_and_request_larger_than_queue(nats_server, start_gateway):
    # a lane with a registered worker that does not consume: work piles up in the stream
    # one item per message: the limit counts the stream's messages
    h = await start_gateway(
        gateway_max_stream_pending=3, gateway_request_timeout_s=3.0, gateway_work_chunk_items=1
    )
    w = await FakeWorker(nats_server.url, "w1", consume=False).start()
    try:
        await wait_workers(h)
        stuck = asyncio.create_task(
            post(h, f"/v1/encode/{DENSE}", {"items": [{"text": str(i)} for i in range(3)]})
        )
        await asyncio.sleep(0.6)
        status, headers, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "more"}]})
        assert status == 503 and body["detail"]["code"] == "QUEUE_FULL" and "Retry-After" in headers
        status, _, body = await post(
            h, f"/v1/encode/{DENSE}", {"items": [{"text": str(i)} for i in range(4)]}
        )
        assert (
            status == 400
            and body["detail"]["code"] == "INVALID_INPUT"
            and "3 or fewer" in body["detail"]["message"]
        )
        status, _, _ = await stuck
        assert status == 504
    finally:
        await w.stop()


async def test_bad_requests_get_their_codes_and_do_not_disturb_others(nats_server, start_gateway):
    h = await start_gateway(gateway_max_body_bytes=64 * 1024, gateway_max_items=10)
    w = await FakeWorker(nats_server.url, "w1").start()
    try:
        await wait_workers(h)
        url = h.url(f"/v1/encode/{DENSE}")

        async def raw(data: bytes, headers=SDK):
            async with h.session.post(url, data=data, headers=headers) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), await resp.json()

        good = [post(h, f"/v1/encode/{DENSE}", {"items": [{"text": f"t{i}"}]}) for i in range(5)]
        bad = [
            raw(b"\xc1\xc1garbage"),
            raw(b"x" * (70 * 1024)),
            raw(packb({"items": []})),
            raw(packb({"items": [{"text": "a"}] * 11})),
            raw(packb({"items": "nope"})),
            raw(packb({"items": [{"text": "a"}], "params": {"output_types": ["sparse"]}})),
            raw(packb({"items": [{"text": "a"}], "params": {"options": {"profile": "nope"}}})),
            raw(b"{not json", {"Content-Type": "application/json"}),
        ]
        results = await asyncio.gather(*good, *bad)
        for status, _, body in results[:5]:
            assert status == 200, body
        statuses = [(s, b["detail"]["code"]) for s, ct, b in results[5:]]
        assert statuses == [
            (400, "INVALID_INPUT"),
            (413, "INPUT_TOO_LONG"),
            (400, "INVALID_INPUT"),
            (400, "INVALID_INPUT"),
            (400, "INVALID_INPUT"),
            (400, "INVALID_INPUT"),
            (400, "INVALID_INPUT"),
            (400, "INVALID_INPUT"),
        ]
        assert all(ct.startswith("application/json") for _, ct, _ in results[5:])
        status, _, body = await post(h, "/v1/encode/no/such-model", {"items": [{"text": "a"}]})
        assert status == 404 and body["detail"]["code"] == "MODEL_NOT_FOUND"
    finally:
        await w.stop()


async def test_worker_errors_surface_with_contract_codes(nats_server, start_gateway):
    from protocol.work import WorkResult

    async def loading(item, worker):
        return WorkResult(item.work_item_id, item.request_id, item.item_index, success=False,
                          error="loading", error_code="MODEL_LOADING", retry_after_s=2)  # fmt: skip

    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1", handler=loading).start()
    try:
        await wait_workers(h)
        status, headers, body = await post(
            h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}, {"text": "b"}]}
        )
        assert (
            status == 503 and headers["X-SIE-Error-Code"] == "MODEL_LOADING" and headers["Retry-After"] == "2"
        )
    finally:
        await w.stop()


async def test_models_health_and_openai(nats_server, start_gateway):
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1", loaded=(DENSE,)).start()
    try:
        await wait_workers(h)
        async with h.session.get(h.url("/v1/models"), headers={"Accept": "application/json"}) as resp:
            models = (await resp.json())["models"]
        names = {m["name"]: m for m in models}
        assert {DENSE, f"{DENSE}:query", RERANK, EXTRACT} <= set(names)
        assert names[DENSE]["dims"]["dense"] == 4 and names[DENSE]["loaded"] is True
        async with h.session.get(h.url("/v1/models/no/such")) as resp:
            assert resp.status == 404 and (await resp.json())["detail"]["code"] == "MODEL_NOT_FOUND"
        async with h.session.get(h.url("/health")) as resp:
            health = await resp.json()
        assert health["type"] == "gateway" and health["cluster"]["worker_count"] == 1
        assert health["live_gpu_types"] == ["cpu"] and health["workers"][0]["gpu"] == "cpu"

        async with h.session.post(
            h.url("/v1/embeddings"), json={"model": DENSE, "input": ["a", "b"]}
        ) as resp:
            assert resp.status == 200
            emb = await resp.json()
        assert emb["object"] == "list" and [d["index"] for d in emb["data"]] == [0, 1]
        assert emb["data"][1]["embedding"] == pytest.approx(fake_vector("b").tolist())
        async with h.session.post(
            h.url("/v1/embeddings"), json={"model": DENSE, "input": "a", "encoding_format": "base64"}
        ) as resp:
            import base64

            vec = np.frombuffer(base64.b64decode((await resp.json())["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(vec, fake_vector("a"))
        async with h.session.post(
            h.url("/v1/embeddings"), json={"model": DENSE, "input": "a", "dimensions": 5}
        ) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "unsupported_field"
        async with h.session.post(h.url("/v1/embeddings"), json={"model": "nope", "input": "a"}) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        async with h.session.post(h.url("/v1/embeddings"), json={"model": DENSE, "input": []}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_request"
    finally:
        await w.stop()


async def test_results_that_share_a_message_answer_their_requests(nats_server, start_gateway):
    """A sidecar sends a batch's results for one gateway in one message to its results subject;
    a malformed one there is dropped without disturbing the requests that follow."""
    h = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1", together=True).start()
    try:
        await wait_workers(h, 1)
        await w.nc.publish(h.gateway.dispatcher.inbox.results_subject, b"\xc1 not a results message")
        texts = ["alpha", "beta", "gamma", "delta"]
        replies = await asyncio.gather(
            post(h, f"/v1/encode/{DENSE}", {"items": [{"text": t} for t in texts]}),
            post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "solo"}]}),
        )
        for (status, _, body), sent in zip(replies, [texts, ["solo"]], strict=True):
            assert status == 200, body
            for it, text in zip(body["items"], sent, strict=True):
                np.testing.assert_array_equal(it["dense"]["values"], fake_vector(text))
        # the route named the subject the results came on
        assert {WorkCodec.routes(hdr)[0].results_subject for hdr in w.seen_headers} == {
            h.gateway.dispatcher.inbox.results_subject
        }
    finally:
        await w.stop()


async def test_equal_misses_of_concurrent_requests_are_computed_once(nats_server, start_gateway):
    h = await start_gateway(result_cache_enabled=True)
    release = asyncio.Event()
    calls: list[str] = []

    async def held(item, worker):
        calls.append(item.item.text)
        await release.wait()
        if item.item.text == "fails first" and calls.count("fails first") == 1:
            return WorkResult.failure(item, "INFERENCE_ERROR", "injected", worker_id=worker.worker_id)
        return answer(item, worker.worker_id)

    w = await FakeWorker(nats_server.url, "w1", handler=held).start()
    try:
        await wait_workers(h)
        first = asyncio.create_task(post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "shared"}]}))
        await wait_until(lambda: calls == ["shared"], what="the first request's item on the worker")
        second = asyncio.create_task(
            post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "other"}, {"text": "shared"}]})
        )
        published = 'sie_gateway_queue_items_published_total{operation="encode"} 2.0'
        await wait_until(
            lambda: published in h.gateway.metrics.render().decode(), what="the second request's own item"
        )
        release.set()
        for task, texts in ((first, ["shared"]), (second, ["other", "shared"])):
            status, _, body = await task
            assert status == 200, body
            for it, text in zip(body["items"], texts, strict=True):
                np.testing.assert_array_equal(it["dense"]["values"], fake_vector(text))
        assert calls == ["shared", "other"]  # "shared" once for both requests
        assert "sie_gateway_result_cache_followed_total 1.0" in h.gateway.metrics.render().decode()

        # a computation that failed hands its follower nothing: the follower computes it itself
        release.clear()
        calls.clear()
        failing = asyncio.create_task(post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "fails first"}]}))
        await wait_until(lambda: calls == ["fails first"], what="the failing item on the worker")
        follower = asyncio.create_task(post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "fails first"}]}))
        followed = "sie_gateway_result_cache_followed_total 2.0"  # the first test's one, and this
        await wait_until(lambda: followed in h.gateway.metrics.render().decode(), what="the follower waiting")
        release.set()
        assert (await failing)[0] == 500
        status, _, body = await follower
        assert status == 200, body
        assert calls.count("fails first") == 2
    finally:
        await w.stop()
