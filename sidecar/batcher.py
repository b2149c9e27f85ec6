"""Batch formation, free of I/O: one Batcher per (operation, group key, priority class) inside a
model's scheduler.

The group key (:attr:`protocol.work.WorkItem.group_key`) covers everything that decides how an item
runs (LoRA, options, instruction, output types, ...), so a batch cut here is what the worker runs:
the one batching decision of the cluster path (the worker only bands it by token length).

Flush rules: total cost >= max_batch_cost, count >= max_batch_requests, or the oldest pending item has
waited max_batch_wait_ms; and at once when the caller says so (``flush_now``: the worker has a
forward free for the model, or the sidecar stops), except while a request's items are still arriving. A request's items are
published together but reach the sidecar one message at a time, over up to a few milliseconds; cut
between two of them, the request would wait a whole extra forward for its last items. So an idle
flush waits, at most ``gather_s`` after a request's first item came, for the rest of it (the
gateway says how many there are, ``RoutingHeader.request_items``, when this pod is the only one
pulling the lane: with several, JetStream deals the items round their pull requests).

Packing sorts the pending items by cost and takes greedily under both caps; an item larger than the
cost cap on its own leaves alone. The remainder stays queued and its wait timer is re-anchored to its
oldest item.

Time is an argument (``now``), never read here: the scheduler passes its clock's reading
(:mod:`protocol.clock`), so tests step through the rules with the times they choose.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from protocol.subjects import BULK, INTERACTIVE


class Costed(Protocol):
    cost: int
    arrived: float  # monotonic seconds

    @property
    def request_id(self) -> str: ...

    @property
    def request_items(self) -> int: ...  # items of its request to expect here (1: nothing to wait for)


E = TypeVar("E", bound=Costed)


@dataclass
class BatchLimits:
    max_cost: int
    max_requests: int
    max_wait_s: float
    gather_s: float = 0.0  # how long an idle flush waits for the rest of a request (after its first item)


class Batcher(Generic[E]):
    """Pending items of one (op, group key, priority class) for one model."""

    def __init__(self, op: str, group: str, priority: str = INTERACTIVE) -> None:
        self.op = op
        self.group = group
        self.priority = priority
        self.pending: list[E] = []
        self.pending_cost = 0
        # requests of several items not all here yet: request id -> (items seen, first one's arrival)
        self._arriving: dict[str, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, entry: E) -> None:
        self.pending.append(entry)
        self.pending_cost += entry.cost
        if entry.request_items > 1:
            rid = entry.request_id
            seen, first = self._arriving.get(rid, (0, entry.arrived))
            if seen + 1 >= entry.request_items:
                self._arriving.pop(rid, None)
            else:
                self._arriving[rid] = (seen + 1, first)

    def gathering_until(self, now: float, limits: BatchLimits) -> float | None:
        """While some pending item's request has more items on the way (its first came less than
        ``gather_s`` ago): when the wait for them ends. None when an idle flush need not wait."""
        if limits.gather_s <= 0 or not self._arriving:
            return None
        for rid in [rid for rid, (_, first) in self._arriving.items() if now >= first + limits.gather_s]:
            del self._arriving[rid]  # waited long enough: the rest may come later, or never
        if not self._arriving:
            return None
        here = {e.request_id for e in self.pending}
        return min(
            (first + limits.gather_s for rid, (_, first) in self._arriving.items() if rid in here),
            default=None,
        )

    @property
    def head_time(self) -> float | None:
        """Arrival time of the oldest pending item (None when empty)."""
        return min((e.arrived for e in self.pending), default=None)

    def due_at(self, limits: BatchLimits, now: float, *, flush_now: bool = False) -> float | None:
        """When a rule flushes (None when empty): the wait rule, or under ``flush_now`` the end of
        the wait for a request's remaining items."""
        head = self.head_time
        if head is None:
            return None
        due = head + limits.max_wait_s
        until = self.gathering_until(now, limits) if flush_now else None
        return due if until is None else min(due, until)

    def full(self, limits: BatchLimits) -> bool:
        """Whether a batch cut now would be full: by cost, by count, or an oversize item alone."""
        return (
            self.pending_cost >= limits.max_cost
            or len(self.pending) >= limits.max_requests
            or any(e.cost >= limits.max_cost for e in self.pending)
        )

    def ready(self, now: float, limits: BatchLimits, *, flush_now: bool = False) -> bool:
        """Whether to cut a batch now: full, oversize, waited ``max_wait_s``, or ``flush_now``
        (the sidecar stops, or the worker has a forward free for the model, so waiting for more
        items would only add latency) unless a pending request's items are still arriving."""
        if not self.pending:
            return False
        if self.full(limits):
            return True
        head = self.head_time
        if head is not None and now >= head + limits.max_wait_s:
            return True
        return flush_now and self.gathering_until(now, limits) is None

    def take(self, limits: BatchLimits) -> list[E]:
        """Pack one batch: ascending cost, greedily under both caps, at least one item."""
        if not self.pending:
            return []
        order = sorted(
            range(len(self.pending)), key=lambda i: (self.pending[i].cost, self.pending[i].arrived)
        )
        chosen: list[int] = []
        total = 0
        for i in order:
            cost = self.pending[i].cost
            if chosen and (total + cost > limits.max_cost or len(chosen) >= limits.max_requests):
                break
            chosen.append(i)
            total += cost
            if len(chosen) >= limits.max_requests or total >= limits.max_cost:
                break
        picked = set(chosen)
        batch = [self.pending[i] for i in sorted(chosen, key=lambda i: self.pending[i].arrived)]
        self.pending = [e for i, e in enumerate(self.pending) if i not in picked]
        self.pending_cost -= total
        return batch

    def remove(self, predicate: Callable[[E], bool]) -> list[E]:
        """Take out every pending entry for which ``predicate(entry)`` holds."""
        gone = [e for e in self.pending if predicate(e)]
        if gone:
            self.pending = [e for e in self.pending if not predicate(e)]
            self.pending_cost = sum(e.cost for e in self.pending)
        return gone


def oldest_ready(
    batchers: list[Batcher[E]],
    now: float,
    limits: BatchLimits,
    *,
    flush_now: bool = False,
    bulk_after_s: float = math.inf,
) -> Batcher[E] | None:
    """Interactive first, then first-come-first-served: the ready batcher whose head is oldest among
    the interactive ones, else among the bulk ones. A bulk batcher whose head has waited
    ``bulk_after_s`` counts as interactive (bulk is never starved)."""
    ready = [b for b in batchers if b.ready(now, limits, flush_now=flush_now)]

    def rank(b: Batcher[E]) -> tuple[bool, float]:
        head = b.head_time or 0.0
        return (b.priority == BULK and now - head < bulk_after_s, head)

    return min(ready, key=rank) if ready else None


def next_due(
    batchers: list[Batcher[E]], limits: BatchLimits, now: float, *, flush_now: bool = False
) -> float | None:
    dues = [d for d in (b.due_at(limits, now, flush_now=flush_now) for b in batchers) if d is not None]
    return min(dues) if dues else None
