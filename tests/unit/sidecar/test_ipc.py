"""IPC framing, envelopes and the worker's IPC server, over a real Unix socket and a real Runtime (fake adapter)."""

from __future__ import annotations

import asyncio
import os
import stat
import struct
import time

import msgpack
import numpy as np
import pytest

from iokit import frames
from protocol import ipc
from protocol.api import Item
from protocol.catalog import Catalog
from protocol.codec import packb, unpackb
from protocol.jobs import Job, JobItem
from protocol.model_config import parse_model_yaml
from protocol.work import WorkResult
from protocol.work_codec import WorkCodec, encode_input
from protocol.work_codec import encode_job as job_bytes
from sidecar.ipc_client import IpcClient, IpcRemoteError, IpcTransportError
from tests.support.jobs import encode_job
from worker.adapters.fake import fake_vector
from worker.ipc.server import serve_ipc
from worker.runtime import Runtime
from worker.settings import WorkerSettings

FAKE_YAML = """
sie_id: test/fake-embed
package_backed: true
tasks:
  encode:
    dense: {{dim: 8}}
profiles:
  default:
    adapter_path: worker.adapters.fake:FakeAdapter
    max_batch_tokens: 2048
    adapter_options:
      loadtime: {loadtime}
"""


def fake_runtime(**loadtime) -> Runtime:
    opts = "{" + ", ".join(f"{k}: {v}" for k, v in loadtime.items()) + "}"
    config = parse_model_yaml(FAKE_YAML.format(loadtime=opts))
    return Runtime(WorkerSettings(device="cpu", cpu_workers=1), catalog=Catalog([config]))


def work_item(
    i: int, text: str = "hello world", request_id: str = "req-1", job: Job | None = None
) -> JobItem:
    return JobItem(job or encode_job(request_id, 3, model_id="test/fake-embed"), i, Item(text=text))


def batch(items: list[JobItem]) -> ipc.RunBatchRequest:
    """The RunBatch of ``items`` as the sidecar sends it: each job's bytes once."""
    jobs: dict[int, bytes] = {}
    parts = [
        (it.work_item_id, jobs.setdefault(id(it.job), job_bytes(it.job)), encode_input(it.index, it.input))
        for it in items
    ]
    return WorkCodec.run_batch("test/fake-embed", parts, worker_id="", priority="interactive")


# ----------------------------------------------------------------------------- framing


def test_frame_roundtrip_and_layout():
    env = ipc.request_envelope(ipc.PING, "7", {"timestamp_ms": 1})
    frame = ipc.encode_frame(env)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert ipc.decode_payload(frame[4:]) == env


async def _reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_read_frame_clean_eof_empty_and_truncated():
    assert await frames.read_frame_bytes(await _reader_of(b"")) is None
    assert await frames.read_frame_bytes(await _reader_of(struct.pack(">I", 0))) == b""
    with pytest.raises(ipc.FrameError):
        await frames.read_frame_bytes(await _reader_of(b"\x00\x00"))
    with pytest.raises(ipc.FrameError):
        await frames.read_frame_bytes(await _reader_of(struct.pack(">I", 10) + b"abc"))


async def test_oversize_frame_is_refused_without_reading_the_body():
    reader = await _reader_of(struct.pack(">I", ipc.MAX_FRAME_BYTES + 1) + b"x")
    with pytest.raises(ipc.FrameTooLarge):
        await frames.read_frame_bytes(reader)
    with pytest.raises(ipc.FrameTooLarge):
        ipc.encode_frame({"blob": b"x" * 100}, max_bytes=50)


def test_garbage_payloads_are_frame_errors():
    with pytest.raises(ipc.FrameError):
        ipc.decode_payload(b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(ipc.FrameError):
        ipc.decode_payload(msgpack.packb([1, 2, 3]))


def test_dispositions():
    assert ipc.disposition_for(True, None) == ipc.PUBLISH_AND_ACK
    assert ipc.disposition_for(False, "RESOURCE_EXHAUSTED") == ipc.NAK_RETRY
    assert ipc.disposition_for(False, "MODEL_LOADING") == ipc.NAK_RETRY
    assert ipc.disposition_for(False, "INVALID_INPUT") == ipc.PUBLISH_ERROR_AND_ACK
    assert ipc.disposition_for(False, "MODEL_LOAD_FAILED") == ipc.PUBLISH_ERROR_AND_ACK


# ----------------------------------------------------------------------------- server


@pytest.fixture
def sock_path(tmp_path):
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    path = f"/tmp/sie-ipc-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    yield path
    if os.path.exists(path):
        os.unlink(path)


async def _raw_exchange(path: str, data: bytes) -> list[dict]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    out = []
    try:
        while True:
            payload = await asyncio.wait_for(frames.read_frame_bytes(reader), 10)
            if payload is None:
                break
            out.append(unpackb(payload))
            if len(out) >= 2:
                break
    finally:
        writer.close()
    return out


async def test_server_socket_mode_and_stale_socket(sock_path):
    with open(sock_path, "w"):
        pass
    os.unlink(sock_path)
    import socket as pysocket

    stale = pysocket.socket(pysocket.AF_UNIX)
    stale.bind(sock_path)  # a stale socket file of a previous run
    stale.close()
    runtime = fake_runtime()
    await runtime.start()
    server = await serve_ipc(runtime, sock_path, worker_id="w-1")
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        client = IpcClient(sock_path)
        pong = ipc.PingResponse.from_map(await client.call(ipc.PING, {"timestamp_ms": 5}))
        assert pong.worker_id == "w-1" and pong.ready and pong.timestamp_ms == 5
        await client.close()
    finally:
        await server.close()
        await runtime.close()
    assert not os.path.exists(sock_path)


async def test_garbage_and_bad_envelopes_get_errors_and_the_connection_survives(sock_path):
    runtime = fake_runtime()
    await runtime.start()
    server = await serve_ipc(runtime, sock_path)
    try:
        garbage = b"\xc1\xc1\xc1"
        ping = ipc.encode_frame(ipc.request_envelope(ipc.PING, "after-garbage", {}))
        replies = await _raw_exchange(sock_path, struct.pack(">I", len(garbage)) + garbage + ping)
        assert replies[0]["ok"] is False and "malformed" in replies[0]["error"]
        assert replies[0]["error_code"] == ipc.IPC_BAD_REQUEST
        assert replies[1]["ok"] is True and replies[1]["request_id"] == "after-garbage"

        bad_version = ipc.encode_frame({"version": 99, "method": "Ping", "request_id": "v", "body": {}})
        unknown = ipc.encode_frame(ipc.request_envelope("Nope", "u", {}))
        replies = await _raw_exchange(sock_path, bad_version + unknown)
        assert replies[0] == {
            "version": 1,
            "request_id": "v",
            "ok": False,
            "body": None,
            "error": "unsupported IPC version 99",
            "error_code": ipc.IPC_BAD_REQUEST,
        }
        assert replies[1]["request_id"] == "u" and replies[1]["ok"] is False

        # a client sees a logical error as IpcRemoteError and keeps its connection
        client = IpcClient(sock_path)
        with pytest.raises(IpcRemoteError) as unknown_method:
            await client.call("Nope", {})
        assert unknown_method.value.code == ipc.IPC_BAD_REQUEST
        with pytest.raises(IpcRemoteError):
            await client.call(ipc.RUN_BATCH, {"model_id": "x"})
        assert (await client.call(ipc.PING, {}))["ready"] is True
        assert client.generation == 1
        await client.close()
    finally:
        await server.close()
        await runtime.close()


async def test_oversize_frame_closes_only_that_connection(sock_path):
    runtime = fake_runtime()
    await runtime.start()
    server = await serve_ipc(runtime, sock_path)
    try:
        replies = await _raw_exchange(sock_path, struct.pack(">I", ipc.MAX_FRAME_BYTES + 1) + b"\x00" * 16)
        assert len(replies) == 1 and replies[0]["ok"] is False and "exceeds" in replies[0]["error"]
        client = IpcClient(sock_path)
        assert (await client.call(ipc.PING, {}))["ready"] is True
        await client.close()
    finally:
        await server.close()
        await runtime.close()


async def test_ensure_then_run_batch_and_multiplexing(sock_path):
    runtime = fake_runtime(batch_delay_ms=1500)
    await runtime.start()
    server = await serve_ipc(runtime, sock_path, worker_id="w-2")
    client = IpcClient(sock_path)
    try:
        states = []
        for _ in range(200):
            resp = ipc.EnsureModelReadyResponse.from_map(
                await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "test/fake-embed"})
            )
            states.append(resp.state)
            if resp.state == ipc.STATE_READY:
                break
            await asyncio.sleep(0.05)
        assert states[-1] == ipc.STATE_READY
        assert states[0] in (ipc.STATE_LOADING_STARTED, ipc.STATE_READY)
        assert resp.max_batch_tokens == 2048 and resp.batch_budget > 0

        job = encode_job("req-1", 3, model_id="test/fake-embed")
        items = [work_item(i, f"text number {i}", job=job) for i in range(3)]
        # the items travel as the gateway encoded them; the results come back encoded
        batch_task = asyncio.create_task(client.call(ipc.RUN_BATCH, batch(items).to_map()))
        await asyncio.sleep(0.3)
        # the slow batch does not hold up a Ping on the same connection
        pong = await asyncio.wait_for(client.call(ipc.PING, {}), 1.0)
        assert not batch_task.done()
        assert "test/fake-embed" in pong["loaded_models"]
        outcomes = (await batch_task)["outcomes"]
        assert [o["work_item_id"] for o in outcomes] == ["req-1.0", "req-1.1", "req-1.2"]
        assert all(o["disposition"] == ipc.PUBLISH_AND_ACK for o in outcomes)
        results = [WorkResult.from_msgpack(o["result"]) for o in outcomes]
        assert [r.work_item_id for r in results] == ["req-1.0", "req-1.1", "req-1.2"]
        first = unpackb(results[0].result_msgpack)
        assert first["dense"]["dims"] == 8 and first["dense"]["values"].shape == (8,)
        assert results[0].worker_id == "w-2"

        # a batch that does not name each of its items is refused, naming why
        for bad in ({"items": [b"x"]}, {"items": "x", "item_ids": ["a"]}, {"item_ids": [1], "items": [b"x"]}):
            with pytest.raises(IpcRemoteError, match="malformed RunBatch") as refused:
                await client.call(ipc.RUN_BATCH, {"model_id": "test/fake-embed", "item_job": [0], **bad})
            assert refused.value.code == ipc.IPC_BAD_REQUEST

        # an item that does not decode is answered dead_letter under its id, and the rest of the
        # batch runs; so are the items of a job that does not decode
        mixed = batch([items[0]])
        mixed.items += [b"\xc1 poison", packb({"x": 1}), packb({"i": 0, "item": {"text": "t"}})]
        mixed.item_ids += ["req-9.0", "req-9.2", "req-8.0"]
        mixed.jobs.append(b"\xc1")
        mixed.item_job += [0, 0, 1]
        outcomes = (await client.call(ipc.RUN_BATCH, mixed.to_map()))["outcomes"]
        by_id = {o["work_item_id"]: o for o in outcomes}
        assert sorted(by_id) == ["req-1.0", "req-8.0", "req-9.0", "req-9.2"]
        assert by_id["req-1.0"]["disposition"] == ipc.PUBLISH_AND_ACK
        for dead in ("req-9.0", "req-9.2", "req-8.0"):
            assert by_id[dead]["disposition"] == ipc.DEAD_LETTER
            assert by_id[dead]["error"].startswith("undecodable work item:")
        assert "its job does not decode" in by_id["req-8.0"]["error"]

        unknown = ipc.EnsureModelReadyResponse.from_map(
            await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "no/such-model"})
        )
        assert unknown.state == ipc.STATE_FAILED and unknown.error_code == "MODEL_NOT_FOUND"
    finally:
        await client.close()
        await server.close()
        await runtime.close()


async def test_a_batch_of_several_jobs_runs_each_item_with_its_own(sock_path):
    """Items of several jobs in one batch, each job's bytes once: each item runs with its job."""
    runtime = fake_runtime()
    await runtime.start()
    server = await serve_ipc(runtime, sock_path, worker_id="w")
    client = IpcClient(sock_path)
    try:
        while (await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "test/fake-embed"}))[
            "state"
        ] != "ready":
            await asyncio.sleep(0.05)
        texts = ["alpha", "beta", "gamma"]
        one = encode_job("req-1", 3, model_id="test/fake-embed")
        items = [work_item(i, t, job=one) for i, t in enumerate(texts)]
        other = work_item(0, "delta", "req-2")
        request = batch([items[2], other, items[0], items[1]])
        assert len(request.jobs) == 2 and request.item_job == [0, 1, 0, 0]
        outcomes = (await client.call(ipc.RUN_BATCH, request.to_map()))["outcomes"]
        results = {o["work_item_id"]: WorkResult.from_msgpack(o["result"]) for o in outcomes}
        for i, text in enumerate(texts):
            dense = unpackb(results[f"req-1.{i}"].result_msgpack)["dense"]["values"]
            np.testing.assert_array_equal(dense, fake_vector(text, 8))
            assert results[f"req-1.{i}"].request_id == "req-1" and results[f"req-1.{i}"].item_index == i
        whole = unpackb(results["req-2.0"].result_msgpack)["dense"]["values"]
        np.testing.assert_array_equal(whole, fake_vector("delta", 8))
        assert results["req-2.0"].request_id == "req-2"

        # item_job must name a job for every item
        for item_job in ([0], [0, 3]):
            bad = batch(items[:2])
            bad.item_job = item_job
            try:
                answer = await client.call(ipc.RUN_BATCH, bad.to_map())
            except IpcRemoteError as exc:
                assert "malformed RunBatch" in str(exc)
            else:
                assert {o["disposition"] for o in answer["outcomes"]} <= {
                    ipc.DEAD_LETTER,
                    ipc.PUBLISH_AND_ACK,
                }
                assert any(o["disposition"] == ipc.DEAD_LETTER for o in answer["outcomes"])
    finally:
        await client.close()
        await server.close()
        await runtime.close()


async def test_drain_refuses_new_batches(sock_path):
    runtime = fake_runtime()
    await runtime.start()
    server = await serve_ipc(runtime, sock_path)
    client = IpcClient(sock_path)
    try:
        ack = await client.call(ipc.DRAIN, {"deadline_ms": 1000})
        assert ack["acknowledged"] is True
        request = batch([work_item(0)])
        with pytest.raises(IpcRemoteError, match=ipc.DRAINING_ERROR) as refused:
            await client.call(ipc.RUN_BATCH, request.to_map())
        assert refused.value.code == ipc.IPC_DRAINING
        ensure = ipc.EnsureModelReadyResponse.from_map(
            await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "test/fake-embed"})
        )
        assert (ensure.state, ensure.error_code) == (ipc.STATE_RETRY_LATER, ipc.IPC_DRAINING)
        assert (await client.call(ipc.PING, {}))["ready"] is False
    finally:
        await client.close()
        await server.close()
        await runtime.close()


async def test_a_batch_runs_in_the_class_the_sidecar_names(sock_path):
    """RunBatch's ``priority`` reaches the runtime; a missing one (an older sidecar) or an unknown one
    is interactive."""
    runtime = fake_runtime()
    await runtime.start()
    seen: list[str] = []
    run = runtime.run_work_items

    async def recording(items, *, priority):
        seen.append(priority)
        return await run(items, priority=priority)

    runtime.run_work_items = recording  # type: ignore[method-assign]
    server = await serve_ipc(runtime, sock_path)
    client = IpcClient(sock_path)
    try:
        body = batch([work_item(0)]).to_map()
        for priority in ("bulk", "interactive", "urgent!", None):
            sent = (
                dict(body, priority=priority)
                if priority
                else {k: v for k, v in body.items() if k != "priority"}
            )
            await client.call(ipc.RUN_BATCH, sent)
        assert seen == ["bulk", "interactive", "interactive", "interactive"]
    finally:
        await client.close()
        await server.close()
        await runtime.close()


async def test_client_fails_pending_calls_when_the_worker_goes_away(sock_path):
    runtime = fake_runtime(batch_delay_ms=3000)
    await runtime.start()
    server = await serve_ipc(runtime, sock_path)
    client = IpcClient(sock_path)
    try:
        for _ in range(200):
            body = await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "test/fake-embed"})
            if body["state"] == ipc.STATE_READY:
                break
            await asyncio.sleep(0.05)
        request = batch([work_item(0)])
        pending = asyncio.create_task(client.call(ipc.RUN_BATCH, request.to_map()))
        await asyncio.sleep(0.3)
        await server.close()
        with pytest.raises(IpcTransportError):
            await pending
        with pytest.raises(IpcTransportError):
            await client.call(ipc.PING, {})
    finally:
        await client.close()
        await runtime.close()


async def test_apply_and_replace_model_configs(sock_path):
    runtime = fake_runtime()
    await runtime.start()
    server = await serve_ipc(runtime, sock_path)
    client = IpcClient(sock_path)
    try:
        new_yaml = FAKE_YAML.format(loadtime="{}").replace("test/fake-embed", "test/added-later")
        before = (await client.call(ipc.PING, {}))["bundle_config_hash"]
        applied = await client.call(
            ipc.APPLY_MODEL_CONFIG,
            {"bundle_id": "default", "model_id": "test/added-later", "epoch": 2, "model_config": new_yaml},
        )
        assert applied["applied"] is True and applied["unsupported_models"] == []
        assert "test/added-later" in runtime.catalog
        assert applied["bundle_config_hash"] == (await client.call(ipc.PING, {}))["bundle_config_hash"]
        assert isinstance(before, str)
        resp = await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "test/added-later"})
        assert resp["state"] in (ipc.STATE_LOADING_STARTED, ipc.STATE_READY)

        replaced = await client.call(
            ipc.REPLACE_MODEL_CONFIGS,
            {
                "bundle_id": "default",
                "epoch": 3,
                "models": [
                    {"model_id": "test/added-later", "model_config": new_yaml},
                    {"model_id": "test/broken", "model_config": "sie_id: test/broken\nprofiles: {}\n"},
                ],
            },
        )
        assert replaced["applied_models"] == ["test/added-later"]
        assert replaced["unsupported_models"] == ["test/broken"]
        assert replaced["config_version"] == 2
    finally:
        await client.close()
        await server.close()
        await runtime.close()
