"""`sie serve`'s front door and LoRAs (issue 56), over real HTTP: a request selects an adapter by a
NAME its model's config declares; a path, ``~``, a hub id, a long string, or any LoRA on a model
that declares none is a 400 INVALID_INPUT naming the declared adapters, answered before any model
or adapter load, any file of the weight cache, or the hub."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from protocol.catalog import Catalog
from protocol.model_config import ModelConfig
from tests.support.worker_parts import TASKS, fake_config
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

PLAIN = "sie-fake"
WITH = "sie-fake-lora"
JSON = {"Content-Type": "application/json", "Accept": "application/json"}
ATTACKS = ["/etc", "~", "../..", "/proc/self", "some-org/undeclared", "x" * 10_000]


@pytest.fixture
async def served(tmp_path):
    adapter_dir = tmp_path / "adapters" / "one"
    adapter_dir.mkdir(parents=True)
    with_loras = ModelConfig.model_validate(
        {
            **fake_config(WITH, tasks=TASKS).model_dump(exclude_none=True),
            "loras": {"one": {"path": str(adapter_dir)}, "two": {"hf_id": "acme/fake-lora-two"}},
        }
    )
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    settings = WorkerSettings(
        machine_profile="cpu",
        device="cpu",
        hf_offline=True,
        disk_cache_dir=str(tmp_path / "disk-cache"),
        cluster_cache_url=str(cluster),
        memory_monitor_interval_s=0,
        torch_threads=1,
    )
    rt = Runtime(settings, Catalog([fake_config(PLAIN, tasks=TASKS), with_loras]))
    async with TestClient(TestServer(create_app(rt, settings))) as client:
        yield client, rt, tmp_path


def bodies(model: str, options: dict) -> list[tuple[str, dict]]:
    return [
        (f"/v1/encode/{model}", {"items": [{"text": "a"}], "params": {"options": options}}),
        (f"/v1/score/{model}", {"query": {"text": "q"}, "items": [{"text": "a"}], "options": options}),
        (f"/v1/extract/{model}", {"items": [{"text": "A b"}], "params": {"options": options}}),
    ]


async def refused(client, path: str, body: dict) -> str:
    started = time.monotonic()
    resp = await client.post(path, data=json.dumps(body).encode(), headers=JSON)
    raw = await resp.read()
    assert time.monotonic() - started < 2.0
    assert resp.status == 400, raw[:500]
    assert resp.headers["X-SIE-Error-Code"] == "INVALID_INPUT"
    detail = json.loads(raw)["detail"]
    assert (detail["code"], detail.get("param")) == ("INVALID_INPUT", "lora"), detail
    message = detail["message"]
    assert len(message) < 300 and "/etc" not in message and "/proc" not in message and "/tmp" not in message
    return str(message)


@pytest.mark.parametrize("attack", ATTACKS, ids=["etc", "home", "dotdot", "proc", "hub", "10kB"])
async def test_a_lora_that_is_not_a_declared_name_is_400_before_anything_is_opened(served, attack):
    client, rt, tmp_path = served
    for key in ("lora", "lora_id"):
        for path, body in bodies(WITH, {key: attack}):
            message = await refused(client, path, body)
            assert message.endswith(f"model '{WITH}' declares: one, two"), message
            if len(attack) > 2:
                assert attack not in message
        for path, body in bodies(PLAIN, {key: attack}):
            assert await refused(client, path, body) == f"Model '{PLAIN}' declares no LoRA adapters"
    # nothing was loaded, fetched or written: the refusals came before the model's load
    assert rt.models.loaded_models() == [] and rt.models.loading_models() == []
    assert not (tmp_path / "disk-cache").exists() or list((tmp_path / "disk-cache").iterdir()) == []
    assert list((tmp_path / "cluster").iterdir()) == []


async def test_a_declared_name_reaches_the_model(served):
    """A declared name passes the front door; the fake adapter runs no LoRA, which the worker says."""
    client, rt, _ = served
    ok = await client.post(
        f"/v1/encode/{WITH}", json={"items": [{"text": "a"}]}, headers={"Accept": "application/json"}
    )
    for _ in range(50):  # the model loads on the first request (503 MODEL_LOADING meanwhile)
        if ok.status == 200:
            break
        await rt.models.entry(rt.catalog.resolve(WITH)).task
        ok = await client.post(
            f"/v1/encode/{WITH}", json={"items": [{"text": "a"}]}, headers={"Accept": "application/json"}
        )
    assert ok.status == 200, await ok.text()
    message = await refused(client, *bodies(WITH, {"lora": "one"})[0])
    assert message == f"Model '{WITH}' does not support LoRA adapters"
