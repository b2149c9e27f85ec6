"""The batching policy (protocol.batching) as the sidecar uses it: flush on cost, count or wait;
packing; oldest head first across groups; interactive before bulk; the gather window. Time is a
ManualClock's reading, moved by the test."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.batching import BatchLimits, BatchQueue, Load
from protocol.subjects import BULK, INTERACTIVE
from tests.support.clock import ManualClock

LIMITS = BatchLimits(max_cost=100, max_requests=4, max_wait_s=0.010)
BUSY = Load(idle_forwards=0)  # the worker's forwards are busy: no reason to flush early
IDLE = Load(flush=True)  # a forward is free: cut what is pending now


@dataclass(eq=False)
class Entry:
    cost: int
    name: str = ""
    request_id: str = ""
    request_items: int = 1


def add(q: BatchQueue[Entry], e: Entry, at: float, group: str = "", priority: str = INTERACTIVE) -> Entry:
    q.append(
        e,
        group=group,
        cost=e.cost,
        arrived=at,
        priority=priority,
        request_id=e.request_id,
        request_items=e.request_items,
    )
    return e


def names(q: BatchQueue[Entry], now: float, load: Load = BUSY) -> list[str] | None:
    batch = q.next_batch(now, load)
    return None if batch is None else [e.name for e in batch.items]


def test_not_due_below_every_threshold_until_the_wait_expires():
    clock = ManualClock()
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    t0 = clock.now()
    add(q, Entry(10), t0)
    clock.advance(0.002)
    add(q, Entry(10), clock.now())
    clock.advance(0.003)
    assert q.next_batch(clock.now(), BUSY) is None
    assert q.due_at(clock.now(), BUSY) == t0 + 0.010
    clock.advance(0.005)
    assert q.due_at(clock.now(), BUSY) == clock.now()
    assert names(q, clock.now()) == ["", ""] and len(q) == 0


def test_flushes_on_count():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    for i in range(4):
        add(q, Entry(1), 1.0 + i * 0.001)
    assert len(names(q, 1.004) or []) == 4
    assert len(q) == 0


def test_flushes_on_cost_and_cuts_the_chunk_holding_the_oldest_entry():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(60, "big"), 1.0)
    add(q, Entry(30, "mid"), 1.001)
    add(q, Entry(20, "small"), 1.002)
    assert q.cost == 110
    # by ascending cost, small (20) + mid (30) fit under 100 and big (60) would pass it: two chunks;
    # the one holding the oldest entry goes first, so a large entry is never starved by small ones
    assert names(q, 1.003) == ["big"]
    assert q.cost == 50
    # the remainder's timer is anchored to its own oldest entry
    assert q.due_at(1.003, BUSY) == 1.001 + 0.010
    assert names(q, 1.011) == ["mid", "small"]


def test_oversize_entry_flushes_alone():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(500, "huge"), 1.0)
    assert names(q, 1.0) == ["huge"]


def test_oversize_entry_next_to_small_ones_goes_alone_and_they_after_it():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(500, "huge"), 1.0)
    add(q, Entry(5, "a"), 1.001)
    assert names(q, 1.001) == ["huge"]
    assert names(q, 1.001) is None  # "a" alone is not full: it waits for the wait rule
    assert names(q, 1.011) == ["a"]


def test_a_flush_cuts_at_once():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(1), 1.0)
    assert q.next_batch(1.0, BUSY) is None
    assert q.next_batch(1.0, IDLE) is not None


def test_count_cap_limits_a_batch():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    for i in range(10):
        add(q, Entry(1), 1.0 + i)
    assert len(names(q, 11.0) or []) == 4
    assert len(q) == 6


def test_batch_keeps_arrival_order():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(9, "first"), 1.0)
    add(q, Entry(1, "second"), 2.0)
    assert names(q, 2.0, IDLE) == ["first", "second"]


def test_oldest_head_wins_across_groups():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(1, "lora"), 1.0, group="my-lora")
    add(q, Entry(1, "base"), 1.005)
    now = 1.02
    batch = q.next_batch(now, BUSY)
    assert batch is not None and batch.group == "my-lora" and [e.name for e in batch.items] == ["lora"]
    assert names(q, now) == ["base"]
    assert q.next_batch(now, BUSY) is None and q.due_at(now, BUSY) is None


def test_groups_never_share_a_batch():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(1, "a"), 1.0, group="a")
    add(q, Entry(1, "b"), 1.0, group="b")
    assert names(q, 1.0, IDLE) == ["a"] and names(q, 1.0, IDLE) == ["b"]


GATHER = BatchLimits(max_cost=1000, max_requests=8, max_wait_s=0.015, gather_s=0.005)


def test_a_flush_waits_for_the_rest_of_a_request_and_cuts_it_whole():
    q: BatchQueue[Entry] = BatchQueue(GATHER)
    add(q, Entry(1, "alone"), 1.0)  # a one-entry request: nothing to wait for
    add(q, Entry(1, "a0", "a", 3), 1.001)
    add(q, Entry(1, "a1", "a", 3), 1.002)
    assert q.next_batch(1.003, IDLE) is None  # a2 is on its way
    assert q.due_at(1.003, IDLE) == 1.001 + 0.005
    assert q.due_at(1.003, BUSY) == 1.0 + 0.015  # a busy worker: only the wait rule
    add(q, Entry(1, "a2", "a", 3), 1.004)
    assert names(q, 1.004, IDLE) == ["alone", "a0", "a1", "a2"]


def test_the_wait_for_a_request_is_bounded_and_never_holds_a_full_batch():
    q: BatchQueue[Entry] = BatchQueue(GATHER)
    add(q, Entry(1, "b0", "b", 2), 1.0)
    assert q.next_batch(1.004, IDLE) is None
    assert names(q, 1.005, IDLE) == ["b0"]  # gather_s after its first entry: go without the rest
    # a straggler far behind looks like a new request's first entry: bounded by gather_s again
    add(q, Entry(1, "b1", "b", 2), 1.2)
    assert q.next_batch(1.2, IDLE) is None and names(q, 1.205, IDLE) == ["b1"]
    # a full batch goes at once, arriving entries or not
    for i in range(8):
        add(q, Entry(1, f"c{i}", "c", 10), 2.0)
    assert len(names(q, 2.0) or []) == 8


def test_a_request_already_cut_holds_nothing_back():
    q: BatchQueue[Entry] = BatchQueue(GATHER)
    add(q, Entry(1, "d0", "d", 3), 1.0)
    assert names(q, 1.02) == ["d0"]  # the wait rule cut it before its siblings came
    add(q, Entry(1, "solo"), 1.021)
    assert names(q, 1.021, IDLE) == ["solo"]  # d's missing entries are nobody's business here


def test_without_gather_a_flush_goes_at_once():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(1, "e0", "e", 4), 1.0)
    assert names(q, 1.0, IDLE) == ["e0"]


def test_remove_by_predicate():
    q: BatchQueue[Entry] = BatchQueue(LIMITS)
    add(q, Entry(3, "keep"), 1.0)
    add(q, Entry(4, "drop"), 1.0, group="other")
    gone = q.remove(lambda e: e.name == "drop")
    assert [e.name for e in gone] == ["drop"]
    assert q.cost == 3 and [e.name for e in q] == ["keep"] and q.groups() == {""}


def test_the_scheduler_learns_tokens_per_character_estimate():
    from sidecar.deliveries import ModelScheduler

    sched = ModelScheduler(spec="m", limits=LIMITS)
    assert sched.cost_of(40) == 40  # no evidence yet: the estimate as it is
    for _ in range(300):  # this model's tokenizer makes 2.5 tokens per estimated unit
        sched.learn(40, 100)
    assert abs(sched.tokens_per_estimate - 2.5) < 0.01
    assert sched.cost_of(40) == 100
    sched.learn(0, 10)  # nothing to learn from an empty estimate or a missing count
    sched.learn(10, 0)
    assert abs(sched.tokens_per_estimate - 2.5) < 0.01


def test_interactive_goes_first_and_aged_bulk_competes_by_age():
    limits = BatchLimits(max_cost=100, max_requests=4, max_wait_s=0.010, bulk_max_wait_s=2.0)
    for now, first in ((1.6, "query"), (3.0, "old bulk")):
        q: BatchQueue[Entry] = BatchQueue(limits)
        add(q, Entry(1, "old bulk"), 1.0, priority=BULK)
        add(q, Entry(1, "query"), 1.5)
        # the bulk head is older, but interactive work is scheduled first ... until the bulk head
        # has waited bulk_max_wait_s: then the oldest head wins again
        assert names(q, now, IDLE) == [first]
    q = BatchQueue(limits)
    add(q, Entry(1, "old bulk"), 1.0, priority=BULK)
    assert names(q, 1.6, IDLE) == ["old bulk"]
