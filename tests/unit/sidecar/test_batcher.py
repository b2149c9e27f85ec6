"""Batch formation rules of the sidecar (flush on cost, count or wait; packing; FCFS across batchers)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.work import item_cost, text_cost
from sidecar.batcher import Batcher, BatchLimits, next_due, oldest_ready


@dataclass(eq=False)
class Entry:
    cost: int
    arrived: float
    name: str = ""
    request_id: str = ""
    request_items: int = 1


LIMITS = BatchLimits(max_cost=100, max_requests=4, max_wait_s=0.010)


def test_text_cost_is_a_chars_over_four_proxy():
    assert text_cost("") == 2
    assert text_cost("a" * 40) == 12
    assert item_cost("encode", {"text": "a" * 400}) == 102
    assert item_cost("encode", {"images": [b"x", b"y"]}) == 2
    assert item_cost("encode", {"text": "a" * 40, "image": b"x"}) == 12 + 1  # text and media both count
    # score: the query counted once per pair
    assert item_cost("score", None, {"text": "a" * 8}, [{"text": "a" * 4}, {"text": ""}]) == (4 + 3) + (4 + 2)


def test_not_ready_below_every_threshold_until_the_wait_expires():
    b = Batcher("encode", "")
    b.add(Entry(10, arrived=1.0))
    b.add(Entry(10, arrived=1.002))
    assert not b.ready(1.005, LIMITS)
    assert b.due_at(LIMITS, 1.005) == 1.0 + 0.010
    assert b.ready(1.010, LIMITS)


def test_flushes_on_count():
    b = Batcher("encode", "")
    for i in range(4):
        b.add(Entry(1, arrived=1.0 + i * 0.001))
    assert b.ready(1.004, LIMITS)
    assert len(b.take(LIMITS)) == 4
    assert len(b) == 0


def test_flushes_on_cost_and_packs_under_the_cap():
    b = Batcher("encode", "")
    b.add(Entry(60, arrived=1.0, name="big"))
    b.add(Entry(30, arrived=1.001, name="mid"))
    b.add(Entry(20, arrived=1.002, name="small"))
    assert b.pending_cost == 110
    assert b.ready(1.003, LIMITS)
    batch = b.take(LIMITS)
    # ascending cost: small (20) + mid (30) fit; big (60) would pass 100
    assert sorted(e.name for e in batch) == ["mid", "small"]
    assert [e.name for e in b.pending] == ["big"]
    assert b.pending_cost == 60
    # the remainder's timer is anchored to its own oldest item
    assert b.head_time == 1.0


def test_oversize_item_flushes_alone():
    b = Batcher("encode", "")
    b.add(Entry(500, arrived=1.0, name="huge"))
    assert b.ready(1.0, LIMITS)
    assert [e.name for e in b.take(LIMITS)] == ["huge"]


def test_oversize_item_next_to_small_ones_leaves_after_them():
    b = Batcher("encode", "")
    b.add(Entry(500, arrived=1.0, name="huge"))
    b.add(Entry(5, arrived=1.001, name="a"))
    assert b.ready(1.001, LIMITS)
    assert [e.name for e in b.take(LIMITS)] == ["a"]
    assert [e.name for e in b.take(LIMITS)] == ["huge"]


def test_draining_flushes_immediately():
    b = Batcher("encode", "")
    b.add(Entry(1, arrived=1.0))
    assert not b.ready(1.0, LIMITS)
    assert b.ready(1.0, LIMITS, flush_now=True)


def test_count_cap_limits_a_batch():
    b = Batcher("encode", "")
    for i in range(10):
        b.add(Entry(1, arrived=1.0 + i))
    assert len(b.take(LIMITS)) == 4
    assert len(b) == 6


def test_batch_keeps_arrival_order():
    b = Batcher("encode", "")
    b.add(Entry(9, arrived=1.0, name="first"))
    b.add(Entry(1, arrived=2.0, name="second"))
    assert [e.name for e in b.take(LIMITS)] == ["first", "second"]


def test_oldest_head_wins_across_batchers():
    base = Batcher("encode", "")
    lora = Batcher("encode", "my-lora")
    lora.add(Entry(1, arrived=1.0, name="lora"))
    base.add(Entry(1, arrived=1.005, name="base"))
    now = 1.02
    assert oldest_ready([base, lora], now, LIMITS) is lora
    lora.take(LIMITS)
    assert oldest_ready([base, lora], now, LIMITS) is base
    assert next_due([base, lora], LIMITS, now) == 1.005 + 0.010
    base.take(LIMITS)
    assert oldest_ready([base, lora], now, LIMITS) is None
    assert next_due([base, lora], LIMITS, now) is None


GATHER = BatchLimits(max_cost=1000, max_requests=8, max_wait_s=0.015, gather_s=0.005)


def test_an_idle_flush_waits_for_the_rest_of_a_request_and_cuts_it_whole():
    b = Batcher("encode", "")
    b.add(Entry(1, arrived=1.0, name="alone"))  # a one-item request: nothing to wait for
    b.add(Entry(1, arrived=1.001, name="a0", request_id="a", request_items=3))
    b.add(Entry(1, arrived=1.002, name="a1", request_id="a", request_items=3))
    assert not b.ready(1.003, GATHER, flush_now=True)  # a2 is on its way
    assert b.due_at(GATHER, 1.003, flush_now=True) == 1.001 + 0.005
    assert b.due_at(GATHER, 1.003) == 1.0 + 0.015  # a busy worker: only the wait rule
    b.add(Entry(1, arrived=1.004, name="a2", request_id="a", request_items=3))
    assert b.ready(1.004, GATHER, flush_now=True)
    assert [e.name for e in b.take(GATHER)] == ["alone", "a0", "a1", "a2"]


def test_the_wait_for_a_request_is_bounded_and_never_holds_a_full_batch():
    b = Batcher("encode", "")
    b.add(Entry(1, arrived=1.0, name="b0", request_id="b", request_items=2))
    assert not b.ready(1.004, GATHER, flush_now=True)
    assert b.ready(1.005, GATHER, flush_now=True)  # gather_s after its first item: go without the rest
    assert [e.name for e in b.take(GATHER)] == ["b0"]
    # a straggler far behind looks like a new request's first item: bounded by gather_s again
    b.add(Entry(1, arrived=1.2, name="b1", request_id="b", request_items=2))
    assert not b.ready(1.2, GATHER, flush_now=True) and b.ready(1.205, GATHER, flush_now=True)
    b.take(GATHER)
    # a full batch goes at once, arriving items or not
    for i in range(8):
        b.add(Entry(1, arrived=2.0, name=f"c{i}", request_id="c", request_items=10))
    assert b.ready(2.0, GATHER) and len(b.take(GATHER)) == 8


def test_a_request_already_cut_holds_nothing_back():
    b = Batcher("encode", "")
    b.add(Entry(1, arrived=1.0, name="d0", request_id="d", request_items=3))
    assert b.ready(1.02, GATHER)  # the wait rule cut it before its siblings came
    b.take(GATHER)
    b.add(Entry(1, arrived=1.021, name="solo"))
    assert b.ready(1.021, GATHER, flush_now=True)  # d's missing items are nobody's business here


def test_without_gather_an_idle_flush_goes_at_once():
    b = Batcher("encode", "")
    b.add(Entry(1, arrived=1.0, request_id="e", request_items=4))
    assert b.ready(1.0, LIMITS, flush_now=True)


def test_remove_by_predicate():
    b = Batcher("encode", "")
    b.add(Entry(3, arrived=1.0, name="keep"))
    b.add(Entry(4, arrived=1.0, name="drop"))
    gone = b.remove(lambda e: e.name == "drop")
    assert [e.name for e in gone] == ["drop"]
    assert b.pending_cost == 3


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
    bulk = Batcher("encode", "", "bulk")
    interactive = Batcher("encode", "", "interactive")
    bulk.add(Entry(1, arrived=1.0, name="old bulk"))
    interactive.add(Entry(1, arrived=1.5, name="query"))
    # the bulk head is older, but interactive work is scheduled first ...
    assert oldest_ready([bulk, interactive], 1.6, LIMITS, flush_now=True, bulk_after_s=2.0) is interactive
    # ... until the bulk head has waited bulk_after_s: then the oldest head wins again
    assert oldest_ready([bulk, interactive], 3.0, LIMITS, flush_now=True, bulk_after_s=2.0) is bulk
    interactive.take(LIMITS)
    assert oldest_ready([bulk, interactive], 1.6, LIMITS, flush_now=True, bulk_after_s=2.0) is bulk
