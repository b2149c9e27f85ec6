"""The gateway's front door and LoRAs (issue 56): a request selects an adapter by a NAME its model's
config declares; anything else (a path, ``~``, a hub id, a long string, any LoRA on a model that
declares none) is a 400 INVALID_INPUT naming the declared adapters, and nothing is published."""

from __future__ import annotations

import time

import pytest

from tests.integration.gateway.conftest import DENSE, EXTRACT, RERANK, write_catalog
from tests.integration.gateway.fake_worker import FakeWorker
from tests.integration.gateway.test_gateway_flow import post, wait_workers

ATTACKS = ["/etc", "~", "../..", "/proc/self", "some-org/undeclared", "x" * 10_000]


@pytest.fixture
def catalog_dirs(tmp_path):
    """The gateway tests' catalog, its dense model declaring two LoRAs."""
    models, bundles = write_catalog(tmp_path)
    dense = tmp_path / "models" / "dense.yaml"
    dense.write_text(
        dense.read_text()
        + "loras:\n  one: {path: /srv/adapters/one}\n  two: {hf_id: acme/dense-lora-two, revision: v1}\n"
    )
    return models, bundles


@pytest.fixture
async def worker(nats_server):
    """A lane peer (it records every work item it is handed in ``seen``)."""
    w = await FakeWorker(nats_server.url, "w1").start()
    yield w
    await w.stop()


def assert_refused(status: int, headers: dict, body, tail: str) -> None:
    assert status == 400, body
    assert headers["X-SIE-Error-Code"] == "INVALID_INPUT"
    detail = body["detail"]
    assert (detail["code"], detail.get("param")) == ("INVALID_INPUT", "lora"), detail
    message = detail["message"]
    assert message.endswith(tail), message
    assert len(message) < 300 and "/etc" not in message and "/proc" not in message and "/srv" not in message


async def test_a_declared_lora_is_selected_by_name(start_gateway, worker):
    h = await start_gateway()
    await wait_workers(h)
    for options in ({"lora": "one"}, {"lora_id": "two"}):
        status, _, body = await post(
            h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}], "params": {"options": options}}
        )
        assert status == 200, body
    assert [item.job.lora for item in worker.seen] == ["one", "two"]


@pytest.mark.parametrize("attack", ATTACKS, ids=["etc", "home", "dotdot", "proc", "hub", "10kB"])
async def test_anything_else_is_400_and_nothing_is_published(start_gateway, worker, attack):
    h = await start_gateway()
    await wait_workers(h)
    declared = f"model '{DENSE}' declares: one, two"
    for key in ("lora", "lora_id"):
        started = time.monotonic()
        status, headers, body = await post(
            h, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}], "params": {"options": {key: attack}}}
        )
        assert time.monotonic() - started < 2.0
        assert_refused(status, headers, body, declared)
        if len(attack) > 2:
            assert attack not in body["detail"]["message"]
    none = "declares no LoRA adapters"
    status, headers, body = await post(
        h,
        f"/v1/score/{RERANK}",
        {"query": {"text": "q"}, "items": [{"text": "a"}], "options": {"lora": attack}},
    )
    assert_refused(status, headers, body, f"Model '{RERANK}' {none}")
    status, headers, body = await post(
        h, f"/v1/extract/{EXTRACT}", {"items": [{"text": "A b"}], "params": {"options": {"lora": attack}}}
    )
    assert_refused(status, headers, body, f"Model '{EXTRACT}' {none}")
    async with h.session.post(  # Cohere's rerank shape, whose options are the score options
        h.url("/v1/rerank"),
        json={"model": RERANK, "query": "q", "documents": ["a"], "options": {"lora": attack}},
    ) as resp:
        raw = await resp.text()
        assert resp.status == 400 and resp.headers["X-SIE-Error-Code"] == "INVALID_INPUT", raw
        assert none in raw and "/etc" not in raw and "/proc" not in raw
    assert worker.seen == []  # refused at the front door: no work item reached a worker
    status, _, body = await post(h, f"/v1/encode/{DENSE}", {"items": [{"text": "still fine"}]})
    assert status == 200, body
    assert [item.job.lora for item in worker.seen] == [None]
