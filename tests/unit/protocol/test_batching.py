"""The batching policy (protocol.batching) alone: the rules both the sidecar's scheduler and sie
serve's BatchFormer run. Time is a ManualClock's reading, moved by the test; nothing sleeps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from protocol.batching import BatchLimits, BatchQueue, Load
from protocol.subjects import BULK, INTERACTIVE
from tests.support.clock import ManualClock

BUSY = Load(idle_forwards=0)
IDLE = Load(flush=True)


@dataclass(eq=False)
class Unit:
    name: str
    cost: int = 1


def queue(**over: object) -> BatchQueue[Unit]:
    values: dict[str, object] = {"max_requests": 8, "max_cost": 1000, "max_wait_s": 0.010}
    values.update(over)
    return BatchQueue(BatchLimits(**values))  # type: ignore[arg-type]


def put(
    q: BatchQueue[Unit], clock: ManualClock, prefix: str, n: int, priority: str = INTERACTIVE, cost: int = 1
) -> None:
    for i in range(n):
        q.append(Unit(f"{prefix}{i}", cost), group="g", cost=cost, arrived=clock.now(), priority=priority)


def cut(q: BatchQueue[Unit], clock: ManualClock, load: Load = IDLE) -> list[str] | None:
    batch = q.next_batch(clock.now(), load)
    return None if batch is None else [u.name for u in batch.items]


def test_interactive_goes_before_an_older_bulk_backlog():
    clock = ManualClock()
    q = queue(bulk_max_wait_s=60.0)
    put(q, clock, "b", 3, BULK)
    clock.advance(1.0)
    put(q, clock, "i", 2)
    assert cut(q, clock) == ["i0", "i1"]
    assert cut(q, clock) == ["b0", "b1", "b2"]


def test_bulk_batches_are_small_while_interactive_work_arrives_then_full_size():
    clock = ManualClock()
    q = queue(bulk_max_requests=6, bulk_mixed_requests=2, bulk_mixed_window_s=1.0)
    put(q, clock, "i", 1)
    assert cut(q, clock) == ["i0"]
    put(q, clock, "b", 12, BULK)
    assert q.cap(BULK, clock.now()) == 2
    assert cut(q, clock, BUSY) == ["b0", "b1"]  # full at the mixed size: no wait for the wait rule
    clock.advance(1.001)  # no interactive work within the window
    assert q.cap(BULK, clock.now()) == 6 and q.cap(INTERACTIVE, clock.now()) == 8
    assert cut(q, clock, BUSY) == [f"b{i}" for i in range(2, 8)]


def test_the_bulk_cap_never_passes_the_batch_cap():
    q = queue(max_requests=4, bulk_max_requests=16, bulk_mixed_requests=8)
    assert q.cap(BULK, 0.0) == 4


def test_bulk_waits_while_its_running_batches_reach_the_limit():
    clock = ManualClock()
    q = queue(bulk_max_running=1)
    put(q, clock, "b", 2, BULK)
    assert cut(q, clock, Load(flush=True, bulk_running=1)) is None
    assert q.due_at(clock.now(), Load(flush=True, bulk_running=1)) is None  # until one ends
    assert cut(q, clock, Load(flush=True, bulk_running=0)) == ["b0", "b1"]


def test_bulk_that_waited_its_max_wait_since_the_last_cut_takes_turns_with_interactive():
    clock = ManualClock()
    q = queue(max_requests=1, bulk_max_wait_s=0.5)
    put(q, clock, "b", 3, BULK)
    order = []
    for k in range(6):
        clock.advance(0.3)
        q.append(Unit(f"i{k}"), group="g", cost=1, arrived=clock.now())
        order.append((cut(q, clock) or ["?"])[0][0])
    # bulk waits until it has waited 0.5 s, then ranks by when it started waiting (older than the
    # interactive head); its next batch has waited only since that cut, so the two take turns
    assert order == ["i", "b", "i", "b", "i", "b"]


def test_interactive_batches_beyond_the_depth_go_only_when_full():
    clock = ManualClock()
    q = queue(max_requests=2, queued_full_batches=1)
    put(q, clock, "i", 1)
    at_depth = Load(running=1, depth=1, idle_forwards=0)
    clock.advance(1.0)  # long past the wait rule: still held, the worker holds its depth
    assert cut(q, clock, at_depth) is None and q.due_at(clock.now(), at_depth) is None
    put(q, clock, "j", 1)  # full now: it may go on to wait on the worker for a forward
    assert cut(q, clock, at_depth) == ["i0", "j0"]
    put(q, clock, "k", 2)
    assert cut(q, clock, Load(running=2, depth=1, idle_forwards=0)) is None  # queued_full reached


def test_idle_forwards_share_an_interactive_group_and_bulk_is_not_split():
    clock = ManualClock()
    q = queue(max_requests=64)
    put(q, clock, "i", 6)
    two_idle = Load(flush=True, idle_forwards=2)
    assert len(cut(q, clock, two_idle) or []) == 3
    put(q, clock, "b", 6, BULK)
    q.remove(lambda u: u.name.startswith("i"))
    assert len(cut(q, clock, two_idle) or []) == 6


def test_a_quiet_coalesce_window_makes_a_group_due_before_its_wait():
    clock = ManualClock()
    q = queue(max_wait_s=1.0, coalesce_s=0.020)
    put(q, clock, "a", 1)
    clock.advance(0.015)
    put(q, clock, "b", 1)  # an arrival opens a new window
    assert q.due_at(clock.now(), BUSY) == clock.now() + 0.020
    clock.advance(0.020)
    assert cut(q, clock, BUSY) == ["a0", "b0"]


def test_padded_groups_are_cut_in_length_bands_and_packed_ones_by_total_cost():
    clock = ManualClock()
    costs = (8, 9, 10, 100, 110, 120)
    for packed, first in ((False, [8, 9, 10]), (True, list(costs))):
        q: BatchQueue[Unit] = BatchQueue(
            BatchLimits(max_requests=64, max_cost=10_000, max_wait_s=0.01, max_pad_share=0.2),
            packs=(lambda group: True) if packed else (lambda group: False),
        )
        for c in costs:
            q.append(Unit(str(c), c), group="g", cost=c, arrived=clock.now())
        batch = q.next_batch(clock.now(), IDLE)
        assert batch is not None and [u.cost for u in batch.items] == first


def test_the_chunk_holding_the_oldest_entry_goes_first():
    clock = ManualClock()
    q = queue(max_cost=100)
    q.append(Unit("long", 90), group="g", cost=90, arrived=clock.now())
    clock.advance(0.001)
    put(q, clock, "s", 5, cost=10)
    assert cut(q, clock) == ["long"]
    assert cut(q, clock) == [f"s{i}" for i in range(5)]


def test_the_limits_may_change_in_place():
    clock = ManualClock()
    q = queue(max_requests=8)
    put(q, clock, "i", 4)
    q.limits.max_requests = 2  # the sidecar learns the model's batch budget from EnsureModelReady
    assert cut(q, clock, BUSY) == ["i0", "i1"]


def test_an_unknown_priority_is_refused():
    with pytest.raises(ValueError):
        queue().append(Unit("x"), group="g", cost=1, arrived=0.0, priority="urgent")


def test_counts_and_costs_by_class():
    clock = ManualClock()
    q = queue()
    put(q, clock, "i", 2, cost=3)
    put(q, clock, "b", 1, BULK, cost=5)
    assert (len(q), q.count(INTERACTIVE), q.count(BULK), q.cost) == (3, 2, 1, 11)
