"""The Scheduler alone: which batch goes to the worker when, stepped on a manual clock.

The worker, model readiness and settlement are scripted at the Scheduler's Protocol seams, so each
step below says exactly what the scheduler may do; nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from nats.aio.msg import Msg

from protocol import ipc
from protocol.codec import packb
from protocol.subjects import BULK, INTERACTIVE
from sidecar.barrier import ExecutionBarrier
from sidecar.deliveries import Delivery
from sidecar.metrics import SidecarMetrics
from sidecar.scheduling import Scheduler
from sidecar.settings import SidecarSettings
from sidecar.tombstones import Tombstones
from tests.support.clock import ManualClock
from tests.support.polling import wait_until
from tests.unit.sidecar.parts import (
    GatedWorker,
    ReadyModel,
    RecordingSettler,
    StoredPayloads,
    delivery,
    quiesce,
)


@dataclass
class Rig:
    scheduler: Scheduler
    worker: GatedWorker
    readiness: ReadyModel
    settler: RecordingSettler
    clock: ManualClock
    tombstones: Tombstones
    stats: dict[str, int]

    def submit(self, **kw: object) -> str:
        d = delivery(self.clock.now(), **kw)  # type: ignore[arg-type]
        assert self.scheduler.submit([d])
        return d.route.work_item_id


@asynccontextmanager
async def rig(*, depth: int = 1, forwards: int = 1, **settings: object) -> AsyncIterator[Rig]:
    values: dict[str, object] = {
        "worker_id": "w",
        "batcher_max_batch_wait_ms": 10.0,
        "batcher_gather_ms": 0.0,
    }
    values.update(settings)
    clock = ManualClock()
    worker, readiness, settler = GatedWorker(), ReadyModel(depth=depth, forwards=forwards), RecordingSettler()
    payloads = StoredPayloads(
        {"big.1": packb([b"the job from the store", [b"the input from the store"]]), "junk": b"\xc1"}
    )
    tombstones = Tombstones()
    stats: dict[str, int] = {"batches": 0}
    stopping = asyncio.Event()
    scheduler = Scheduler(
        SidecarSettings(**values),  # type: ignore[arg-type]
        worker=worker,
        readiness=readiness,
        settlement=settler,
        payloads=payloads,
        barrier=ExecutionBarrier(),
        tombstones=tombstones,
        metrics=SidecarMetrics("default", "cpu", "default"),
        stats=stats,
        stopping=stopping,
        clock=clock,
    )
    try:
        yield Rig(scheduler, worker, readiness, settler, clock, tombstones, stats)
    finally:
        stopping.set()
        worker.gate.set()
        for sched in scheduler.schedulers.values():
            sched.wake.set()
        await scheduler.finish(5.0)


async def test_an_idle_worker_gets_the_first_item_at_once():
    async with rig() as r:
        first = r.submit()
        await wait_until(lambda: r.worker.batches == [[first]], what="the first batch")
        assert r.clock.t == 1000.0  # no time had to pass
        r.worker.gate.set()
        await wait_until(lambda: r.settler.done, what="its settlement")
        assert r.settler.done == [(f"settle {ipc.PUBLISH_AND_ACK}", first)]
        assert r.readiness.ensured == 1 and r.stats["batches"] == 1


async def test_items_arriving_during_a_forward_join_one_next_batch():
    """The worker takes one batch at once (depth 1): what arrives while it runs waits here, across
    many batch-wait periods, and goes as one batch when the forward ends."""
    async with rig(depth=1) as r:
        r.submit()
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        for _ in range(8):
            r.submit()
            r.clock.advance(0.050)  # five times the batch wait
            await quiesce()
        assert r.worker.sizes == [1]
        assert r.scheduler.queue_depth() == 8
        r.worker.gate.set()
        await wait_until(lambda: r.worker.sizes == [1, 8], what="the second batch")


async def test_with_room_on_the_worker_but_no_forward_free_a_batch_waits_for_the_wait_rule():
    """Depth 2, one forward: while a batch runs the next may go to the worker, but not at once: it
    is cut when its oldest item has waited ``batcher_max_batch_wait_ms`` (or it is full)."""
    async with rig(depth=2, forwards=1) as r:
        r.submit()
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        r.submit()
        r.clock.advance(0.004)
        r.submit()
        await quiesce()
        r.clock.advance(0.005)  # 9 ms after the oldest
        await quiesce()
        assert r.worker.sizes == [1]
        r.clock.advance(0.001)  # 10 ms: the wait rule
        await wait_until(lambda: r.worker.sizes == [1, 2], what="the batch cut by the wait rule")


async def test_a_full_batch_does_not_wait():
    async with rig(depth=2, forwards=1, batcher_max_batch_requests=3) as r:
        r.submit()
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        for _ in range(3):
            r.submit()
        await wait_until(lambda: r.worker.sizes == [1, 3], what="the full batch")
        assert r.clock.t == 1000.0


async def test_full_batches_queue_on_a_busy_worker_up_to_the_setting_and_others_wait():
    """Depth 1: while a batch runs, full batches go on to wait on the worker for its forward (two,
    ``batcher_queued_full_batches``); a third full one, and one not full, wait here."""
    async with rig(depth=1, batcher_max_batch_requests=2, batcher_queued_full_batches=2) as r:
        r.submit()
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        for _ in range(2):
            r.submit()
            r.submit()
            await quiesce()
        await wait_until(lambda: r.worker.sizes == [1, 2, 2], what="two full batches queued")
        r.submit()
        r.submit()
        r.submit()
        r.clock.advance(0.050)  # five times the batch wait: the wait rule does not send them
        await quiesce()
        assert r.worker.sizes == [1, 2, 2] and r.scheduler.queue_depth() == 3
        r.worker.gate.set()
        await wait_until(lambda: sorted(r.worker.sizes) == [1, 1, 2, 2, 2], what="the rest")


async def test_without_queued_full_batches_a_full_batch_waits_for_the_forward():
    async with rig(depth=1, batcher_max_batch_requests=2, batcher_queued_full_batches=0) as r:
        r.submit()
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        r.submit()
        r.submit()
        await quiesce()
        assert r.worker.sizes == [1]
        r.worker.gate.set()
        await wait_until(lambda: r.worker.sizes == [1, 2], what="the full batch after the first")


async def test_an_idle_worker_gets_a_request_whole_when_its_items_arrive_apart():
    """With ``batcher_gather_ms`` an idle flush waits for the rest of a request (the gateway counted
    its items) and sends it as one batch."""
    async with rig(batcher_gather_ms=400.0, batcher_max_batch_wait_ms=1000.0) as r:
        r.submit(request_id="req", request_items=3)
        r.clock.advance(0.100)  # the rest of the request comes 100 ms later
        await quiesce()
        assert r.worker.sizes == []
        r.submit(request_id="req", request_items=3)
        r.submit(request_id="req", request_items=3)
        await wait_until(lambda: r.worker.sizes == [3], what="the whole request")


async def test_without_the_gather_wait_a_request_arriving_apart_is_cut_in_two():
    async with rig(batcher_gather_ms=0.0, batcher_max_batch_wait_ms=1000.0) as r:
        r.submit(request_id="req", request_items=3)
        await wait_until(lambda: r.worker.sizes == [1], what="the first item alone")
        r.clock.advance(0.100)
        r.submit(request_id="req", request_items=3)
        r.submit(request_id="req", request_items=3)
        await quiesce()
        r.worker.gate.set()
        await wait_until(lambda: r.worker.sizes == [1, 2], what="the rest")


async def test_the_gather_wait_is_bounded():
    async with rig(batcher_gather_ms=400.0, batcher_max_batch_wait_ms=1000.0) as r:
        r.submit(request_id="req", request_items=3)
        r.clock.advance(0.399)
        await quiesce()
        assert r.worker.sizes == []
        r.clock.advance(0.001)
        await wait_until(lambda: r.worker.sizes == [1], what="the item, without the rest")


async def test_two_idle_forwards_share_what_is_pending():
    """Six items pending and two forwards free: two batches of three (``protocol.ipc.forward_share``)."""
    async with rig(depth=2, forwards=2) as r:
        for _ in range(6):  # submit does not yield: all six are queued before the scheduler looks
            r.submit()
        await wait_until(lambda: r.worker.sizes == [3, 3], what="two shares")


async def test_cancelled_items_are_dropped_queued_or_cut():
    async with rig(depth=1) as r:
        first = r.submit(request_id="keep")
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        gone = [r.submit(request_id="gone") for _ in range(2)]
        kept = r.submit(request_id="keep")
        await r.scheduler.cancel("gone")
        assert sorted(r.settler.actions("drop")) == sorted(gone)
        r.tombstones.add("late")  # cancelled after intake: dropped from its batch before RunBatch
        late = r.submit(request_id="late")
        r.worker.gate.set()
        await wait_until(lambda: len(r.worker.batches) == 2, what="the second batch")
        assert r.worker.batches == [[first], [kept]]
        assert late in r.settler.actions("drop")


async def test_a_full_queue_refuses_until_half_the_deliveries_are_spent():
    async with rig(depth=1, batcher_max_batch_requests=1, max_concurrent_batches=1) as r:
        r.submit()
        await wait_until(lambda: r.worker.sizes == [1], what="the first batch")
        cap = 1 * 1 * 2
        for _ in range(cap):
            r.submit()
        assert not r.scheduler.submit([delivery(r.clock.now())])
        # a bulk backlog never turns interactive work away, nor the other way round
        assert r.scheduler.submit([delivery(r.clock.now(), priority=BULK)])


async def test_bulk_batches_are_small_while_interactive_work_arrives():
    async with rig(
        depth=2,
        forwards=1,
        bulk_mixed_batch_requests=2,
        bulk_max_batch_requests=8,
        bulk_mixed_window_s=1.0,
        bulk_max_wait_ms=60_000.0,
    ) as r:
        r.submit()  # interactive: the bulk window opens
        await wait_until(lambda: r.worker.sizes == [1], what="the interactive batch")
        for _ in range(6):
            r.submit(priority=BULK)
        r.clock.advance(0.010)
        await wait_until(lambda: r.worker.sizes == [1, 2], what="a mixed-size bulk batch")
        assert r.worker.priorities == [INTERACTIVE, BULK]  # the worker is told each batch's class
        r.worker.gate.set()
        await wait_until(lambda: sum(r.worker.sizes) == 7, what="the rest")
        r.worker.gate.clear()
        r.clock.advance(1.0)  # no interactive item for the window: full bulk batches again
        for _ in range(6):
            r.submit(priority=BULK)
        r.clock.advance(0.010)
        await wait_until(lambda: r.worker.sizes[-1] == 6, what="a full-size bulk batch")


async def test_a_body_in_the_payload_store_goes_to_the_worker_and_a_lost_one_fails_its_item():
    def stored_as(name: str) -> Delivery:
        msg = Msg(None, subject="sie.work.x", data=b"", headers={"Sie-Payload": name})
        return delivery(r.clock.now(), msg=msg)

    async with rig(depth=4) as r:
        stored, lost, junk = stored_as("big.1"), stored_as("gone"), stored_as("junk")
        plain = delivery(r.clock.now())
        for d in (stored, lost, junk, plain):
            assert r.scheduler.submit([d])
        r.clock.advance(1.0)
        await wait_until(lambda: r.worker.batches, what="a batch")
        assert r.worker.batches == [[stored.route.work_item_id, plain.route.work_item_id]]
        assert r.worker.bodies == [[b"the input from the store", b"body"]]
        assert r.worker.jobs == [([b"the job from the store", b"job"], [0, 1])]
        assert sorted(r.settler.actions("publish INTERNAL_ERROR")) == sorted(
            [lost.route.work_item_id, junk.route.work_item_id]
        )
        r.worker.gate.set()


async def test_a_batch_carries_each_job_once():
    """The items of one message share their job's bytes (one object): the batch carries each job
    once, and says which each item takes."""
    async with rig(depth=4) as r:
        one, two = b"job one", b"job two"
        batch = [delivery(r.clock.now()) for _ in range(5)]
        for d, shared in zip(batch, (one, one, two, two, one), strict=True):
            d.shared = shared
        assert r.scheduler.submit(batch)
        r.clock.advance(1.0)
        await wait_until(lambda: r.worker.batches, what="a batch")
        assert r.worker.batches == [[d.route.work_item_id for d in batch]]
        assert r.worker.jobs == [([one, two], [0, 0, 1, 1, 0])]
        r.worker.gate.set()
