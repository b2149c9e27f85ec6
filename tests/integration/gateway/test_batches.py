"""The OpenAI Batch API on the gateway, driven by the real ``openai`` client, against a real
nats-server (files and batches in JetStream) and a test-side lane peer (FakeWorker)."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from protocol.subjects import BULK
from tests.integration.gateway.conftest import DENSE
from tests.integration.gateway.fake_worker import FakeWorker, answer, fake_vector
from tests.support.polling import wait_until

openai = pytest.importorskip("openai")


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def embedding_line(i: int, inputs: str | list[str], model: str = DENSE) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, "input": inputs},
    }


def client(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.url("/v1"), api_key="unused", max_retries=0)


async def finished(oa, batch_id: str, timeout: float = 60.0):
    async def ended():
        b = await oa.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "cancelled", "expired") else None

    return await wait_until(ended, timeout_s=timeout, interval_s=0.2, what=f"batch {batch_id} to end")


def output_lines(content: bytes) -> list[dict]:
    return [json.loads(line) for line in content.splitlines() if line.strip()]


async def test_a_batch_of_embeddings_runs_to_its_output_file(nats_server, start_gateway):
    h = await start_gateway(batch_chunk_lines=40)
    h.gateway.run_batches(h.url(""))
    w = await FakeWorker(nats_server.url, "w1", priority=BULK).start()
    oa = client(h)
    try:
        lines = [embedding_line(i, f"text {i}" if i % 3 else [f"text {i}", "shared"]) for i in range(150)]
        lines.append(embedding_line(150, "x", model="no/such-model"))
        uploaded = await oa.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
        batch = await oa.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"run": "t"},
        )
        assert batch.status == "validating" and batch.metadata == {"run": "t"}
        done = await finished(oa, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            151,
            150,
            1,
        )
        out = output_lines((await oa.files.content(done.output_file_id)).content)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(150))  # each once
        by_id = {o["custom_id"]: o for o in out}
        for i in range(150):
            response = by_id[f"req-{i}"]["response"]
            assert response["status_code"] == 200 and response["request_id"]
            texts = [f"text {i}"] if i % 3 else [f"text {i}", "shared"]
            got = [row["embedding"] for row in response["body"]["data"]]
            np.testing.assert_allclose(
                np.array(got, dtype=np.float32), np.stack([fake_vector(t) for t in texts])
            )
        (err,) = output_lines((await oa.files.content(done.error_file_id)).content)
        assert err["custom_id"] == "req-150" and err["response"]["status_code"] == 404
        assert err["response"]["body"]["error"]["code"] == "model_not_found"
        # the output file is its four chunks' objects, in order, not a copy of them; the error file
        # is the one chunk that had an error line, and the empty error chunks are gone
        store = h.gateway.stores.batches
        content = (await oa.files.content(done.output_file_id)).content
        meta, parts = await store.file_parts(done.output_file_id)
        assert parts == [f"{batch.id}/out/{i:06d}" for i in range(4)]
        assert meta["bytes"] == len(content) == (await oa.files.retrieve(done.output_file_id)).bytes
        assert "_parts" not in meta and all("_parts" not in f for f in await store.list_records("file"))
        assert (await store.file_parts(done.error_file_id))[1] == [f"{batch.id}/err/000003"]
        assert [await store.object_size(f"{batch.id}/err/{i:06d}") for i in range(3)] == [None] * 3
        assert await store.object_size(f"{batch.id}/out/000004") is None  # nothing past the last chunk
        # deleting the output file deletes its parts
        assert (await oa.files.delete(done.output_file_id)).deleted
        assert [await store.object_size(name) for name in parts] == [None] * 4
        with pytest.raises(openai.NotFoundError):
            await oa.files.content(done.output_file_id)
        # the lines ran at bulk priority: every item published was a bulk one
        metrics = h.gateway.metrics.render().decode()
        assert 'sie_gateway_priority_items_total{priority="bulk"} 200.0' in metrics
        assert 'sie_gateway_priority_items_total{priority="interactive"}' not in metrics
        listed = await oa.batches.list(limit=5)
        assert listed.data[0].id == batch.id
        assert (await oa.files.delete(uploaded.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await oa.files.retrieve(uploaded.id)
    finally:
        await oa.close()
        await w.stop()


async def test_a_file_whose_part_is_gone_is_a_404_or_a_broken_transfer(nats_server, start_gateway):
    import aiohttp

    h = await start_gateway()
    store = h.gateway.stores.batches
    await store.files.put("p/0", b"first part\n")
    await store.files.put("p/1", b"second part\n")
    meta = await store.put_parts_file(
        ["p/0", "p/1"], 23, filename="f.jsonl", purpose="batch_output", file_id="file-parts"
    )
    assert meta == {**meta, "id": "file-parts", "bytes": 23}
    async with aiohttp.ClientSession() as session:
        url = h.url("/v1/files/file-parts/content")
        async with session.get(url) as r:
            assert r.status == 200 and await r.read() == b"first part\nsecond part\n"
        await store.delete_object("p/1")  # a later part gone: the answer breaks off short
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.get(url) as r:
                assert r.status == 200
                await r.read()
        await store.delete_object("p/0")  # the first part gone: still an answer that says so
        async with session.get(url) as r:
            assert r.status == 404 and "file-parts" in (await r.json())["error"]["message"]
    # a file of no parts (a completed batch whose every line failed has an empty output file)
    await store.put_parts_file([], 0, filename="e.jsonl", purpose="batch_output", file_id="file-empty")
    oa = client(h)
    try:
        assert (await oa.files.content("file-empty")).content == b""
        assert (await oa.files.delete("file-empty")).deleted
    finally:
        await oa.close()


async def test_a_file_with_bad_lines_fails_the_batch_naming_each(nats_server, start_gateway):
    h = await start_gateway()
    h.gateway.run_batches(h.url(""))
    oa = client(h)
    try:
        good = embedding_line(0, "a")
        bad = [
            b"not json",
            json.dumps({**good, "custom_id": "req-0"}).encode(),  # the same custom_id again
            json.dumps({**good, "custom_id": "g", "url": "/v1/chat/completions"}).encode(),
            json.dumps({**good, "custom_id": "m", "method": "GET"}).encode(),
        ]
        content = jsonl([good]) + b"\n".join(bad) + b"\n"
        uploaded = await oa.files.create(file=("in.jsonl", content), purpose="batch")
        batch = await oa.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        done = await finished(oa, batch.id)
        assert done.status == "failed" and done.output_file_id is None
        assert [(e.line, e.param) for e in done.errors.data] == [
            (2, None),
            (3, "custom_id"),
            (4, "url"),
            (5, "method"),
        ]
        # what the API refuses at once
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await oa.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="1h"
            )
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await oa.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.NotFoundError):
            await oa.batches.create(
                input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await oa.files.create(file=("in.jsonl", content), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
            await oa.batches.cancel(batch.id)
        for odd in ("a.b", "a*", "x" * 65):  # not even a key of the store: still a plain 404
            with pytest.raises(openai.NotFoundError):
                await oa.files.retrieve(odd)
            with pytest.raises(openai.NotFoundError):
                await oa.batches.retrieve(odd)
    finally:
        await oa.close()


async def test_a_file_over_the_limit_is_refused(nats_server, start_gateway):
    h = await start_gateway(batch_max_file_bytes=1000)
    oa = client(h)
    try:
        with pytest.raises(openai.APIStatusError) as err:
            await oa.files.create(file=("in.jsonl", b"x" * 1001), purpose="batch")
        assert err.value.status_code == 413 and "1000 bytes" in err.value.message
    finally:
        await oa.close()


async def test_a_cancelled_batch_stops_and_keeps_what_was_done(nats_server, start_gateway):
    h = await start_gateway(batch_chunk_lines=10, gateway_provisioning_retry_after_s=1)
    h.gateway.run_batches(h.url(""))
    gate = asyncio.Event()

    async def slow(item, worker):
        if (item.item.text or "").startswith("late"):
            await gate.wait()  # never set: these lines are in flight at the cancel
        return answer(item, worker.worker_id)

    w = await FakeWorker(nats_server.url, "w1", handler=slow, priority=BULK).start()
    oa = client(h)
    try:
        lines = [embedding_line(i, f"early {i}") for i in range(10)] + [
            embedding_line(i, f"late {i}") for i in range(10, 30)
        ]
        uploaded = await oa.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await oa.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )

        async def first_chunk_done():
            b = await oa.batches.retrieve(batch.id)
            return b.request_counts.completed == 10

        await wait_until(first_chunk_done, timeout_s=30, what="the first chunk")
        cancelling = await oa.batches.cancel(batch.id)
        assert cancelling.status == "cancelling"
        done = await finished(oa, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        out = output_lines((await oa.files.content(done.output_file_id)).content)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(10))
    finally:
        gate.set()
        await oa.close()
        await w.stop()


async def test_a_batch_whose_gateway_died_is_finished_by_another_without_duplicates(
    nats_server, start_gateway
):
    slow_down = {"on": True}

    async def paced(item, worker):
        if slow_down["on"]:
            await asyncio.sleep(0.05)
        return answer(item, worker.worker_id)

    first = await start_gateway(batch_chunk_lines=20, batch_lease_s=2.0)
    second = await start_gateway(batch_chunk_lines=20, batch_lease_s=2.0)
    w = await FakeWorker(nats_server.url, "w1", handler=paced, priority=BULK).start()
    first.gateway.run_batches(first.url(""))
    oa = client(second)
    try:
        lines = [embedding_line(i, f"text {i}") for i in range(200)]
        uploaded = await oa.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await oa.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )

        async def some_done():
            b = await oa.batches.retrieve(batch.id)
            return b.request_counts.completed >= 40

        await wait_until(some_done, timeout_s=60, what="some chunks on the first gateway")
        # the first gateway's batch work dies where it stands: no lease released, a chunk in flight
        runner_task = next(t for t in first.gateway._tasks if t.get_name() == "batches")
        runner_task.cancel()
        second.gateway.run_batches(second.url(""))
        slow_down["on"] = False
        done = await finished(oa, batch.id)
        assert done.status == "completed"
        out = output_lines((await oa.files.content(done.output_file_id)).content)
        ids = [o["custom_id"] for o in out]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(200)) and len(set(ids)) == 200
        assert (done.request_counts.completed, done.request_counts.failed) == (200, 0)
        for o in out:
            i = int(o["custom_id"].split("-")[1])
            np.testing.assert_allclose(
                o["response"]["body"]["data"][0]["embedding"], fake_vector(f"text {i}")
            )
    finally:
        await oa.close()
        await w.stop()


async def test_sie_batch_submits_a_file_of_texts_and_writes_the_output(nats_server, start_gateway, tmp_path):
    h = await start_gateway(batch_chunk_lines=10)
    h.gateway.run_batches(h.url(""))
    w = await FakeWorker(nats_server.url, "w1", priority=BULK).start()
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"text {i}\n" for i in range(25)) + '"a \\"quoted\\" text"\n')

    async def sie(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deploy.cli", "batch", *args, "--url", h.url(""),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        return proc.returncode, out.decode(), err.decode()

    try:
        code, _, err = await sie("submit", str(texts), "--model", DENSE)
        assert code == 0, err
        assert "26/26 lines (completed)" in err and f"output: {tmp_path / 'texts.out.jsonl'}" in err
        out = output_lines((tmp_path / "texts.out.jsonl").read_bytes())
        by_id = {o["custom_id"]: o["response"]["body"]["data"][0]["embedding"] for o in out}
        assert len(by_id) == 26
        np.testing.assert_allclose(by_id["line-3"], fake_vector("text 2"))
        np.testing.assert_allclose(by_id["line-26"], fake_vector('a "quoted" text'))
        batch_id = err.split("batch ", 1)[1].split()[0]
        code, printed, _ = await sie("status", batch_id)
        assert code == 0 and json.loads(printed)["status"] == "completed"
        code, _, err = await sie("cancel", batch_id)
        assert code == 1 and "cannot be cancelled" in err
        code, _, err = await sie("submit", str(texts))
        assert code == 1 and "needs --model" in err
    finally:
        await w.stop()
