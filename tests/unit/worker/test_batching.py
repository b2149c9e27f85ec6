"""The BatchFormer and its cost-based chunking. Every former here reads a ManualClock: time moves
only when a test moves it, and ``clock.settled()`` says the former has done all it can for now."""

import asyncio

import pytest

from protocol.batching import BatchLimits, chunk_by_cost
from tests.support.clock import ManualClock
from worker.adapters.base import Prepared, RequestContext
from worker.batching.former import BatchFormer, BatchStats


def units(*costs):
    return [Prepared(cost=c, data=c) for c in costs]


def test_chunks_are_sorted_and_respect_padded_cost_and_count():
    us = units(10, 200, 12, 190, 11, 5)
    chunks = chunk_by_cost(us, max_cost=400, max_count=3, max_pad_share=1.0)
    costs = [[us[i].cost for i in c] for c in chunks]
    assert costs == [[5, 10, 11], [12, 190], [200]]
    for c in costs:
        assert max(c) * len(c) <= 400 and len(c) <= 3


def test_spread_lengths_go_into_bands_with_bounded_padding():
    us = units(8, 9, 10, 100, 110, 120, 250)
    chunks = chunk_by_cost(us, max_cost=10_000, max_count=64, max_pad_share=0.2)
    costs = [[us[i].cost for i in c] for c in chunks]
    assert costs == [[8, 9, 10], [100, 110, 120], [250]]
    same = chunk_by_cost(units(*[32] * 40), max_cost=10_000, max_count=64)
    assert len(same) == 1


def test_oversized_unit_runs_alone():
    chunks = chunk_by_cost(units(5000, 3), max_cost=100, max_count=8)
    assert [len(c) for c in chunks] == [1, 1]


def test_packed_chunks_are_cut_by_total_tokens_not_into_bands():
    us = units(8, 9, 10, 100, 110, 120, 250)
    one = chunk_by_cost(us, max_cost=10_000, max_count=64, max_pad_share=0.2, packed=True)
    assert [[us[i].cost for i in c] for c in one] == [[8, 9, 10, 100, 110, 120, 250]]
    # the cap counts real tokens (padded, the first three alone would be 110 x 4 = 440 > 300)
    capped = chunk_by_cost(us, max_cost=300, max_count=64, packed=True)
    assert [[us[i].cost for i in c] for c in capped] == [[8, 9, 10, 100, 110], [120], [250]]
    counted = chunk_by_cost(us, max_cost=10_000, max_count=3, packed=True)
    assert [len(c) for c in counted] == [3, 3, 1]
    assert [len(c) for c in chunk_by_cost(units(5000, 3), max_cost=100, max_count=8, packed=True)] == [1, 1]


def test_padding_is_counted():
    stats = BatchStats()
    stats.record(units(2, 4, 10))
    assert stats.real_tokens == 16 and stats.padded_tokens == 14 and stats.forwards == 1
    assert stats.record(units(2, 4, 10), packed=True) == (16, 0)
    assert stats.real_tokens == 32 and stats.padded_tokens == 14 and stats.forwards == 2


class Recorder:
    def __init__(self):
        self.batches = []

    async def __call__(self, ctx, batch):
        self.batches.append([u.cost for u in batch])
        return [u.data * 2 for u in batch]


def make(
    run,
    clock=None,
    *,
    max_cost,
    max_requests,
    max_wait_ms,
    coalesce_ms,
    max_pad_share=0.2,
    bulk_mixed_requests=8,
    bulk_mixed_window_s=2.0,
    bulk_max_wait_ms=2000.0,
    **opts,
):
    """A former whose limits are built as WorkerSettings.batch_limits builds them."""
    limits = BatchLimits(
        max_requests=max_requests,
        max_cost=max_cost,
        max_wait_s=max_wait_ms / 1000.0,
        coalesce_s=coalesce_ms / 1000.0,
        max_pad_share=max_pad_share,
        bulk_max_requests=max_requests,
        bulk_mixed_requests=bulk_mixed_requests,
        bulk_mixed_window_s=bulk_mixed_window_s,
        bulk_max_wait_s=bulk_max_wait_ms / 1000.0,
    )
    return BatchFormer(run, limits=limits, clock=clock or ManualClock(), **opts)


async def test_a_packed_context_takes_mixed_lengths_in_one_batch():
    ctx = RequestContext(op="encode")
    bands, one = [[8, 9, 10], [100, 110, 120], [250]], [[8, 9, 10, 100, 110, 120, 250]]
    for packs, want in ((None, bands), (lambda c: c is ctx, one)):
        rec = Recorder()
        bf = make(rec, max_cost=10_000, max_requests=64, max_wait_ms=50, coalesce_ms=20, packs=packs)
        await asyncio.gather(*bf.submit(ctx, units(8, 9, 10, 100, 110, 120, 250)))
        await bf.close()
        assert sorted(rec.batches) == want


async def test_concurrent_submissions_share_a_forward_pass():
    rec = Recorder()
    bf = make(rec, max_cost=1000, max_requests=64, max_wait_ms=50, coalesce_ms=20)
    ctx = RequestContext(op="encode")
    futs = bf.submit(ctx, units(3, 4)) + bf.submit(ctx, units(5))
    results = await asyncio.gather(*futs)
    assert [r[0] for r in results] == [6, 8, 10]
    assert rec.batches == [[3, 4, 5]]
    await bf.close()


async def test_different_keys_never_share_a_batch():
    rec = Recorder()
    bf = make(rec, max_cost=1000, max_requests=64, max_wait_ms=20, coalesce_ms=5)
    a = bf.submit(RequestContext(op="encode", is_query=True), units(3))
    b = bf.submit(RequestContext(op="encode", is_query=False), units(4))
    c = bf.submit(RequestContext(op="encode", lora="x"), units(5))
    await asyncio.gather(*a, *b, *c)
    assert sorted(rec.batches) == [[3], [4], [5]]
    await bf.close()


async def test_announced_requests_are_waited_for_and_idle_flushes_at_once():
    rec = Recorder()
    clock = ManualClock()  # never moved here: whatever runs, runs without waiting for a deadline
    bf = make(rec, clock, max_cost=10_000, max_requests=64, max_wait_ms=5_000, coalesce_ms=5_000)
    ctx = RequestContext(op="encode")
    bf.expect()
    bf.expect()
    first = bf.submit(ctx, units(3), expected=True)
    await clock.settled()
    assert not first[0].done() and rec.batches == []  # one announced request is still tokenising
    second = bf.submit(ctx, units(4), expected=True)
    await asyncio.gather(*first, *second)
    assert rec.batches == [[3, 4]]
    # nobody announced: a lone unit runs at once, without waiting for its deadline
    (lone,) = bf.submit(ctx, units(9))
    await lone
    # an announced request that fails to prepare releases the wait
    bf.expect()
    (waiting,) = bf.submit(ctx, units(2))
    await clock.settled()
    assert not waiting.done()
    bf.unexpect()
    await waiting
    await bf.close()


async def test_count_cap_flushes_without_waiting():
    rec = Recorder()
    clock = ManualClock()
    bf = make(
        rec, clock, max_cost=10_000, max_requests=2, max_wait_ms=10_000, coalesce_ms=10_000, max_pad_share=1.0
    )
    bf.expect()  # another request is still tokenising, so only the count cap can flush
    futs = bf.submit(RequestContext(op="encode"), units(1, 2, 3, 4))
    await asyncio.gather(*futs)
    assert rec.batches == [[1, 2], [3, 4]]
    await bf.close()


async def test_wait_deadline_flushes_a_lone_item():
    rec = Recorder()
    clock = ManualClock()
    bf = make(rec, clock, max_cost=10_000, max_requests=64, max_wait_ms=30, coalesce_ms=10_000)
    bf.expect()  # a request that never arrives: only the 30 ms deadline can flush
    (fut,) = bf.submit(RequestContext(op="encode"), units(7))
    await clock.settled()
    clock.advance(0.029)
    await clock.settled()
    assert not fut.done()
    clock.advance(0.002)
    out, info = await fut
    assert out == 14 and info.size == 1
    await bf.close()


async def test_a_quiet_coalesce_window_flushes_before_the_deadline():
    rec = Recorder()
    clock = ManualClock()
    bf = make(rec, clock, max_cost=10_000, max_requests=64, max_wait_ms=1_000, coalesce_ms=20)
    ctx = RequestContext(op="encode")
    bf.expect()  # someone is tokenising, so the queue waits for the window or the deadline
    first = bf.submit(ctx, units(3))
    await clock.settled()
    clock.advance(0.015)
    second = bf.submit(ctx, units(4))  # an arrival opens a new window
    await clock.settled()
    clock.advance(0.015)  # 30 ms since the first, 15 since the last: still open
    await clock.settled()
    assert rec.batches == []
    clock.advance(0.006)
    await asyncio.gather(*first, *second)
    assert rec.batches == [[3, 4]]
    await bf.close()


async def test_failure_fails_only_its_batch_and_close_fails_pending():
    async def run(ctx, batch):
        if any(u.cost == 13 for u in batch):
            raise RuntimeError("boom")
        return [u.cost for u in batch]

    bf = make(run, max_cost=10_000, max_requests=64, max_wait_ms=5, coalesce_ms=1)
    bad = bf.submit(RequestContext(op="encode", instruction="a"), units(13))
    good = bf.submit(RequestContext(op="encode", instruction="b"), units(2))
    with pytest.raises(RuntimeError):
        await bad[0]
    assert (await good[0])[0] == 2
    await bf.close()


async def test_two_in_flight_queues_the_next_batch_while_one_runs():
    started: asyncio.Queue[list[int]] = asyncio.Queue()
    release = asyncio.Event()

    async def run(ctx, us):
        started.put_nowait([u.cost for u in us])
        await release.wait()
        return [u.cost for u in us]

    clock = ManualClock()
    former = make(run, clock, max_cost=10_000, max_requests=64, max_wait_ms=1, coalesce_ms=1, in_flight=2)
    ctx = RequestContext(op="encode")
    first = former.submit(ctx, units(3))
    assert await started.get() == [3]
    second = former.submit(ctx, units(4))
    assert await started.get() == [4]  # handed over before the first finished
    third = former.submit(ctx, units(5))
    await clock.settled()
    assert started.empty() and former.depth == 1  # two in flight: the third waits for one to end
    release.set()
    results = await asyncio.gather(*first, *second, *third)
    assert [r[0] for r in results] == [3, 4, 5] and await started.get() == [5]
    await former.close()


# ---- priority classes ---------------------------------------------------------------------------


class Gate:
    """A forward pass that waits until the test lets it finish: batches start in the former's order
    and the test sees each start (``started``) before deciding what arrives next."""

    def __init__(self):
        self.batches: list[list[str]] = []  # the units' labels, per batch, in start order
        self.started: asyncio.Queue = asyncio.Queue()
        self.open = asyncio.Event()
        self.running = 0
        self.most_running = 0

    async def __call__(self, ctx, batch):
        self.batches.append([u.data for u in batch])
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.started.put_nowait(len(self.batches))
        try:
            await self.open.wait()
        finally:
            self.running -= 1
        return [u.data for u in batch]

    async def next_start(self):
        return await self.started.get()


def labelled(prefix, n):
    return [Prepared(cost=4, data=f"{prefix}{i}") for i in range(n)]


def classes(batches):
    return ["".join(sorted({label[0] for label in b})) for b in batches]


def former(run, clock=None, **over):
    opts = dict(
        max_cost=10_000,
        max_requests=8,
        max_wait_ms=10_000,
        coalesce_ms=10_000,
        bulk_mixed_requests=2,
        bulk_mixed_window_s=3600,
        bulk_max_wait_ms=3_600_000,
    )
    return make(run, clock, **{**opts, **over})


async def test_interactive_overtakes_a_bulk_backlog_and_bulk_shrinks_while_it_arrives():
    gate = Gate()
    bf = former(gate)
    ctx = RequestContext(op="encode")
    bulk = bf.submit(ctx, labelled("b", 40), priority="bulk")
    assert await gate.next_start() == 1  # bulk alone: a full-size batch
    inter = bf.submit(ctx, labelled("i", 3))  # interactive is the default class
    gate.open.set()
    await asyncio.gather(*inter, *bulk)
    # the interactive request ran right after the bulk batch that was on the worker, and bulk
    # batches were cut at the mixed size from then on
    assert classes(gate.batches[:3]) == ["b", "i", "b"]
    assert [len(b) for b in gate.batches] == [8, 3] + [2] * 16
    await bf.close()


async def test_without_interactive_traffic_bulk_keeps_the_full_batch_size():
    gate = Gate()
    gate.open.set()
    clock = ManualClock()
    bf = former(gate, clock, bulk_mixed_window_s=2)
    ctx = RequestContext(op="encode")
    (done,) = bf.submit(ctx, labelled("i", 1))
    await done
    clock.advance(2.5)  # the interactive request is no longer recent
    futs = bf.submit(ctx, labelled("b", 24), priority="bulk")
    await asyncio.gather(*futs)
    assert [len(b) for b in gate.batches] == [1, 8, 8, 8]
    await bf.close()


async def test_at_most_one_bulk_batch_is_in_flight_and_interactive_runs_beside_it():
    gate = Gate()
    clock = ManualClock()
    bf = former(gate, clock, in_flight=2)
    ctx = RequestContext(op="encode")
    bulk = bf.submit(ctx, labelled("b", 16), priority="bulk")
    bulk += bf.submit(RequestContext(op="encode", is_query=True), labelled("c", 16), priority="bulk")
    await gate.next_start()
    await clock.settled()  # a free slot and two bulk queues: still only one bulk batch started
    assert len(gate.batches) == 1 and gate.running == 1
    inter = bf.submit(ctx, labelled("i", 2))
    await gate.next_start()  # the second slot takes the interactive batch at once
    assert classes(gate.batches) == ["b", "i"] and gate.running == 2
    gate.open.set()
    await asyncio.gather(*inter, *bulk)
    assert gate.most_running == 2
    await bf.close()


async def test_interactive_batches_use_both_slots():
    gate = Gate()
    bf = former(gate, in_flight=2, max_requests=2)
    futs = bf.submit(RequestContext(op="encode"), labelled("i", 4))
    await gate.next_start()
    await gate.next_start()
    assert gate.running == 2
    gate.open.set()
    await asyncio.gather(*futs)
    await bf.close()


async def _bulk_behind_an_interactive_stream(bulk_max_wait_ms: float, batches: int) -> list[str]:
    """A bulk backlog, and interactive work that keeps arriving: one new interactive unit while each
    batch runs, each batch running two milliseconds. The classes of the first ``batches`` batches."""
    gate = Gate()
    clock = ManualClock()
    bf = former(gate, clock, max_requests=1, bulk_mixed_requests=1, bulk_max_wait_ms=bulk_max_wait_ms)
    ctx = RequestContext(op="encode")
    (first,) = bf.submit(ctx, labelled("i", 1))
    await gate.next_start()
    clock.advance(0.001)
    bulk = bf.submit(ctx, labelled("b", 3), priority="bulk")
    futs = [first]
    for n in range(batches - 1):
        clock.advance(0.001)
        futs += bf.submit(ctx, labelled(f"i{n}-", 1))
        clock.advance(0.001)  # the running batch takes a millisecond more
        gate.open.set()
        gate.open.clear()  # let exactly the running batch finish
        await gate.next_start()
    out = classes(gate.batches[:batches])
    gate.open.set()
    await asyncio.gather(*futs, *bulk)
    await bf.close()
    return out


async def test_a_bulk_backlog_is_starved_by_interactive_work_until_its_max_wait():
    assert "b" not in await _bulk_behind_an_interactive_stream(3_600_000, 8)


async def test_bulk_past_its_max_wait_progresses_despite_interactive_work():
    # waited past its max wait (0 here): each bulk batch competes as interactive work that arrived
    # when the previous bulk batch was cut, so bulk and the interactive stream take turns
    order = await _bulk_behind_an_interactive_stream(0, 8)
    assert order.count("b") == 3 and order[0] == "i"
    assert "bb" not in "".join(order)  # never two bulk batches in a row while interactive waits


async def test_an_unknown_priority_is_refused():
    bf = former(Recorder())
    with pytest.raises(ValueError):
        bf.submit(RequestContext(op="encode"), units(1), priority="urgent")
    await bf.close()


async def test_idle_forward_threads_share_a_lone_request():
    """Two forward threads idle and one request of 8: two forwards of 4, one per thread; with one (CUDA:
    the second slot only queues) the request stays one forward."""
    for threads, expected in ((2, [[4, 4, 4, 4], [4, 4, 4, 4]]), (1, [[4] * 8])):
        rec = Recorder()
        bf = make(
            rec,
            max_cost=10_000,
            max_requests=64,
            max_wait_ms=50,
            coalesce_ms=20,
            in_flight=2,
            forward_threads=threads,
        )
        await asyncio.gather(*bf.submit(RequestContext(op="encode"), units(*[4] * 8)))
        assert rec.batches == expected, threads
        await bf.close()
