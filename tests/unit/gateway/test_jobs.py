"""gateway.jobs alone: a request's job built once its lane is chosen, its messages, a body too large
for NATS in the payload store, and a dead-lettered message read back."""

from __future__ import annotations

from functools import partial

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.jobs import JobBuilder, JobRequest, cache_keys, dead_items
from gateway.registry import Route
from gateway.routing import Lane
from gateway.workers import WorkerRecord
from protocol.api import Item
from protocol.catalog import Catalog
from protocol.errors import SIEError
from protocol.jobs import EncodeJob
from protocol.work import Heartbeat
from protocol.work_codec import WorkCodec
from tests.support.jobs import encode_params
from tests.support.worker_parts import TASKS, fake_config

LANE = Lane("default", "cpu", "default")
CONFIG = fake_config("m", tasks=TASKS)
ROUTE = Route(Catalog([CONFIG]).resolve("m"), ["default"])


class Store:
    """The payload store as the gateway writes it (iokit.payloads)."""

    def __init__(self, *, fails: bool = False) -> None:
        self.objects: dict[str, bytes] = {}
        self.fails = fails

    async def put(self, name: str, data: bytes) -> None:
        if self.fails:
            raise OSError("store down")
        self.objects[name] = data

    async def delete(self, name: str) -> None:
        self.objects.pop(name, None)


def builder(*, pods: int = 1, max_payload: int = 0, store: Store | None = None) -> JobBuilder:
    beat = Heartbeat(name="w", ready=True, machine_profile="cpu", pool_name="default", bundle="default")
    workers = [WorkerRecord(f"w{i}", beat, 0.0) for i in range(pods)]
    return JobBuilder(
        router_id="gw",
        results_subject="_INBOX.gw.results",
        bundle_hash=lambda bundle: f"hash-of-{bundle}",
        healthy=lambda: workers,
        payloads=store or Store(),  # type: ignore[arg-type]
        offloads=Counter("offloads", "", registry=CollectorRegistry()),
        max_payload=lambda: max_payload,
        chunk_items=32,
    )


def request(texts: list[str]) -> JobRequest:
    return JobRequest("encode", partial(EncodeJob, params=encode_params()), [Item(text=t) for t in texts])


def items(b: JobBuilder, texts: list[str]):
    return b.job_items(
        request(texts), lane=LANE, route=ROUTE, request_id="r", reply="_INBOX.gw.r", deadline_ts=9.0
    )


def test_one_job_carries_the_routing_fields_of_the_request():
    got = items(builder(), ["a", "b"])
    assert [it.index for it in got] == [0, 1] and got[0].job is got[1].job
    job = got[0].job
    assert (job.request_id, job.model_id, job.pool_name, job.machine_profile, job.router_id) == (
        "r", "m", "default", "cpu", "gw",
    )  # fmt: skip
    assert (job.reply_subject, job.deadline, job.bundle, job.bundle_config_hash, job.total_items) == (
        "_INBOX.gw.r", 9.0, "default", "hash-of-default", 2,
    )  # fmt: skip
    assert len(cache_keys(got, CONFIG)) == 2 and len(set(cache_keys(got, CONFIG))) == 2


async def test_a_request_is_split_over_the_pods_of_its_lane_and_one_pod_is_told_the_count():
    one = builder()
    plan = one.plan(LANE, items(one, list("abcd")))
    msgs = await one.messages(plan)
    assert [m.slots for m in msgs] == [(0, 1, 2, 3)]
    assert {r.request_items for r in WorkCodec.routes(msgs[0].headers)} == {4}
    two = builder(pods=2)
    msgs = await two.messages(two.plan(LANE, items(two, list("abcd"))))
    assert [m.slots for m in msgs] == [(0, 1), (2, 3)]
    assert {r.request_items for m in msgs for r in WorkCodec.routes(m.headers)} == {2}
    assert {r.results_subject for m in msgs for r in WorkCodec.routes(m.headers)} == {"_INBOX.gw.results"}


async def test_a_body_over_the_max_payload_goes_to_the_payload_store():
    store = Store()
    b = builder(max_payload=4096 + 2000, store=store)
    msgs = await b.messages(b.plan(LANE, items(b, ["x" * 5000, "small"])))
    big, small = msgs
    assert big.payload == b"" and big.offloaded == "r.0" and WorkCodec.payload_ref(big.headers) == "r.0"
    assert [it.item.text for it in WorkCodec.items_of(store.objects["r.0"])] == ["x" * 5000]
    assert small.offloaded is None and WorkCodec.payload_ref(small.headers) is None
    await b.forget_payloads(["r.0"])
    assert store.objects == {}
    down = builder(max_payload=4096 + 2000, store=Store(fails=True))
    with pytest.raises(SIEError) as refused:
        await down.messages(down.plan(LANE, items(down, ["x" * 5000])))
    assert refused.value.code == "QUEUE_UNAVAILABLE"


async def test_a_dead_lettered_message_names_this_gateways_items_only():
    b = builder()
    [msg] = await b.messages(b.plan(LANE, items(b, ["a", "b"])))
    assert dead_items(msg.payload, "gw") == [("r", 0), ("r", 1)]
    assert dead_items(msg.payload, "another-gateway") == []
    with pytest.raises(ValueError):
        dead_items(b"\xc1", "gw")
