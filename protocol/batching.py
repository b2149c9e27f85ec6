"""The batching policy of the cluster path (the sidecar's scheduler) and of ``sie serve`` (the
worker's BatchFormer): one pure, synchronous queue that says which batch goes next and when.

Entries queue per (priority class, group): a group is everything that decides how an entry runs
(operation, LoRA, options, instruction, ...), so entries of one group may share a forward pass and
entries of two groups never do. Each side keeps its own I/O (the sidecar's RunBatch calls, the
BatchFormer's futures and forward threads) and asks the queue, with the time it reads from its
:class:`protocol.clock.Clock` and the :class:`Load` of its consumer:

- :meth:`BatchQueue.next_batch` ``(now, load)``: the batch to cut now, or None;
- :meth:`BatchQueue.due_at` ``(now, load)``: when one will be (None: not before the load changes or
  more arrives).

The rules, all here:

- **When a group is due.** At once when full (its cost reaches ``max_cost``, its count the cap of
  its class, or one entry costs ``max_cost`` alone); else when its oldest entry has waited
  ``max_wait_s``, or nothing new came for ``coalesce_s``; and at once under ``load.flush`` (the
  consumer has a forward free, or stops: waiting would only add latency), except while a request's
  entries are still arriving: then at most ``gather_s`` after its first came (a request's entries
  reach the sidecar one message at a time; cut between two, it would wait a whole extra forward).
- **Which group goes.** Interactive before bulk, oldest head first. A bulk group that has waited
  ``bulk_max_wait_s`` for its next batch (since its oldest entry came or its last batch was cut,
  whichever is later) ranks as interactive work that arrived then, so bulk is never starved, and a
  bulk backlog never ranks above interactive work arriving while it is worked through.
- **Which groups may go.** Bulk only while fewer than ``bulk_max_running`` bulk batches are out;
  interactive while fewer than ``load.depth`` interactive batches are (0: no bound), and up to
  ``queued_full_batches`` more when full (they wait on the consumer for a forward, so it starts the
  next the moment one ends).
- **What a batch holds.** At most ``max_requests`` entries (an equal share each when several
  forwards are idle, :func:`protocol.ipc.forward_share`); a bulk batch at most
  ``bulk_max_requests``, and ``bulk_mixed_requests`` while interactive work came within
  ``bulk_mixed_window_s`` (the next interactive entry waits behind one small bulk batch at most).
  Entries are cut by cost (:func:`chunk_by_cost`) and the chunk holding the oldest entry goes, so a
  large entry is never starved by a stream of small ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from protocol.ipc import forward_share
from protocol.subjects import BULK, INTERACTIVE, PRIORITIES

T = TypeVar("T")


class Costed(Protocol):
    @property
    def cost(self) -> int: ...


@dataclass
class BatchLimits:
    """One model's batching settings (the sidecar's from SidecarSettings and EnsureModelReady, sie
    serve's from WorkerSettings and the model's profile)."""

    max_requests: int  # entries per batch
    max_cost: int  # cost (tokens) per batch
    max_wait_s: float  # longest wait for a batch to fill, from its oldest entry
    gather_s: float = 0.0  # a flush waits at most this long for the rest of a request (0: never)
    coalesce_s: float = math.inf  # due once nothing new came for this long
    max_pad_share: float = 1.0  # cut a padded group's batch where pads would pass this share
    queued_full_batches: int = 0  # full interactive batches sent beyond the consumer's depth
    bulk_max_requests: int = 2**31  # entries per bulk batch (capped by max_requests)
    bulk_mixed_requests: int = 8  # entries per bulk batch while interactive work is arriving
    bulk_mixed_window_s: float = 2.0  # interactive work seen this recently: bulk batches are small
    bulk_max_wait_s: float = 2.0  # a bulk group waiting this long ranks as interactive work
    bulk_max_running: int = 1  # bulk batches out at once


@dataclass(frozen=True)
class Load:
    """What the consumer of the batches (the worker's forwards) holds now."""

    running: int = 0  # its batches that count against ``depth``
    bulk_running: int = 0  # its bulk batches
    depth: int = 0  # interactive batches it takes at once (0: no bound)
    idle_forwards: int = 1  # forwards free now: each gets an equal share of an interactive group
    flush: bool = False  # cut what is due by its group's rules at once (no reason to wait)


@dataclass
class Batch(Generic[T]):
    group: Hashable
    priority: str
    items: list[T]


@dataclass
class _Entry(Generic[T]):
    item: T
    cost: int
    arrived: float
    request_id: str
    request_items: int


def chunk_by_cost(
    units: Sequence[Costed],
    max_cost: int,
    max_count: int,
    max_pad_share: float = 0.2,
    *,
    packed: bool = False,
) -> list[list[int]]:
    """Indices of ``units`` sorted by cost and cut into chunks.

    A chunk ends when the next unit would break the cost cap, the count cap, or make pad positions
    more than ``max_pad_share`` of the chunk's padded tokens: equal lengths share one big forward
    pass, spread-out lengths go into length bands. The cost of a padded chunk is its width x count;
    a ``packed`` chunk (its forward runs without padding) costs its real tokens and has no pad
    positions, so mixed lengths share one forward pass up to the caps.
    """
    order = sorted(range(len(units)), key=lambda i: units[i].cost)
    chunks: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        width = units[i].cost  # ascending, so the newest member is the widest
        n = len(current) + 1
        if packed:
            over = real + width > max_cost
        else:
            over = width * n > max_cost or 1.0 - (real + width) / (width * n) > max_pad_share
        if current and (n > max_count or over):
            chunks.append(current)
            current, real = [], 0
        current.append(i)
        real += width
    if current:
        chunks.append(current)
    return chunks


@dataclass
class _Group(Generic[T]):
    """The pending entries of one (priority class, group), in arrival order."""

    priority: str
    key: Hashable
    packed: bool
    entries: list[_Entry[T]] = field(default_factory=list)
    cost: int = 0
    last_arrival: float = -math.inf
    last_cut: float = -math.inf
    # requests of several entries not all here yet: request id -> (entries seen, first one's arrival)
    arriving: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def head(self) -> float:
        return self.entries[0].arrived

    def add(self, entry: _Entry[T]) -> None:
        self.entries.append(entry)
        self.cost += entry.cost
        self.last_arrival = max(self.last_arrival, entry.arrived)
        if entry.request_items > 1:
            seen, first = self.arriving.get(entry.request_id, (0, entry.arrived))
            if seen + 1 >= entry.request_items:
                self.arriving.pop(entry.request_id, None)
            else:
                self.arriving[entry.request_id] = (seen + 1, first)

    def gathering_until(self, now: float, gather_s: float) -> float | None:
        """While a pending entry's request has more on the way (its first came less than
        ``gather_s`` ago): when the wait for them ends; else None."""
        if gather_s <= 0 or not self.arriving:
            return None
        for rid in [rid for rid, (_, first) in self.arriving.items() if now >= first + gather_s]:
            del self.arriving[rid]  # waited long enough: the rest may come later, or never
        here = {e.request_id for e in self.entries} if self.arriving else set()
        return min(
            (first + gather_s for rid, (_, first) in self.arriving.items() if rid in here), default=None
        )

    def remove(self, keep: list[_Entry[T]]) -> None:
        self.entries = keep
        self.cost = sum(e.cost for e in keep)


class BatchQueue(Generic[T]):
    """Pending entries of one model, and the policy that cuts them into batches (module doc)."""

    def __init__(
        self, limits: BatchLimits, *, packs: Callable[[Hashable], bool] = lambda group: True
    ) -> None:
        """``limits`` may be changed in place (the sidecar learns a model's from EnsureModelReady);
        ``packs(group)``: whether the group's forward runs packed, so its batches are cut by total
        cost rather than into length bands (each entry's cost is what it adds to the batch)."""
        self.limits = limits
        self.packs = packs
        self.last_interactive = -math.inf  # arrival of the newest interactive entry
        self._groups: dict[tuple[str, Hashable], _Group[T]] = {}

    # ------------------------------------------------------------------ contents
    def append(
        self,
        item: T,
        *,
        group: Hashable,
        cost: int,
        arrived: float,
        priority: str = INTERACTIVE,
        request_id: str = "",
        request_items: int = 1,
    ) -> None:
        """Queue ``item`` in ``priority``'s class; ``request_items``: how many entries of its request
        to expect (1: nothing to wait for)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        key = (priority, group)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(priority, group, self.packs(group))
        g.add(_Entry(item, cost, arrived, request_id, request_items))
        if priority == INTERACTIVE:
            self.last_interactive = max(self.last_interactive, arrived)

    def __len__(self) -> int:
        return sum(len(g.entries) for g in self._groups.values())

    def __iter__(self) -> Iterator[T]:
        return (e.item for g in self._groups.values() for e in g.entries)

    def groups(self) -> set[Hashable]:
        """The groups with entries pending (of either class)."""
        return {g.key for g in self._groups.values()}

    def count(self, priority: str) -> int:
        return sum(len(g.entries) for g in self._groups.values() if g.priority == priority)

    @property
    def cost(self) -> int:
        return sum(g.cost for g in self._groups.values())

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        """Take out every pending item for which ``predicate(item)`` holds."""
        gone: list[T] = []
        for key, g in list(self._groups.items()):
            keep = [e for e in g.entries if not predicate(e.item)]
            if len(keep) != len(g.entries):
                gone.extend(e.item for e in g.entries if predicate(e.item))
                g.remove(keep)
            if not g.entries:
                del self._groups[key]
        return gone

    # ------------------------------------------------------------------ the policy
    def cap(self, priority: str, now: float) -> int:
        """Most entries per batch of ``priority``'s class now."""
        lim = self.limits
        if priority != BULK:
            return lim.max_requests
        most = min(lim.max_requests, lim.bulk_max_requests)
        if now - self.last_interactive <= lim.bulk_mixed_window_s:
            most = min(most, lim.bulk_mixed_requests)
        return max(1, most)

    def _full(self, g: _Group[T], now: float) -> bool:
        lim = self.limits
        return (
            len(g.entries) >= self.cap(g.priority, now)
            or g.cost >= lim.max_cost
            or any(e.cost >= lim.max_cost for e in g.entries)
        )

    def _held_back(self, g: _Group[T], now: float, load: Load) -> bool:
        """Whether the consumer's load keeps ``g`` from going now."""
        lim = self.limits
        if g.priority == BULK:
            return load.bulk_running >= lim.bulk_max_running
        if not load.depth or load.running < load.depth:
            return False
        return load.running >= load.depth + lim.queued_full_batches or not self._full(g, now)

    def _due(self, g: _Group[T], now: float, load: Load) -> float | None:
        """When ``g`` may be cut (``now`` or earlier: now); None while the load keeps it back."""
        if self._held_back(g, now, load):
            return None
        if self._full(g, now):
            return now
        lim = self.limits
        due = min(g.head + lim.max_wait_s, g.last_arrival + lim.coalesce_s)
        if not load.flush:
            return due
        until = g.gathering_until(now, lim.gather_s)
        return now if until is None else min(due, until)

    def _rank(self, g: _Group[T], now: float) -> tuple[bool, float]:
        if g.priority != BULK:
            return (False, g.head)
        since = max(g.head, g.last_cut)  # a backlog's next batch has waited since the last cut
        return (now - since < self.limits.bulk_max_wait_s, since)

    def due_at(self, now: float, load: Load) -> float | None:
        """When :meth:`next_batch` will cut a batch (at most ``now``: now); None when nothing may
        go until the load changes or more arrives."""
        dues = [d for d in (self._due(g, now, load) for g in self._groups.values()) if d is not None]
        return min(dues, default=None)

    def next_batch(self, now: float, load: Load) -> Batch[T] | None:
        """Cut the batch that goes now, if any: of the due groups the best ranked, its chunk
        holding its oldest entry, in arrival order."""
        due = [g for g in self._groups.values() if (d := self._due(g, now, load)) is not None and d <= now]
        if not due:
            return None
        g = min(due, key=lambda g: self._rank(g, now))
        most = self.cap(g.priority, now)
        if g.priority != BULK:
            most = forward_share(len(g.entries), load.idle_forwards, most)
        # bands among the oldest entries only: sorting a deep queue on every cut would cost time
        # quadratic in its depth
        window = g.entries[: 8 * self.limits.max_requests]
        chunks = chunk_by_cost(window, self.limits.max_cost, most, self.limits.max_pad_share, packed=g.packed)
        chunk = sorted(next(c for c in chunks if 0 in c))
        taken = set(chunk)
        batch = Batch(g.key, g.priority, [window[i].item for i in chunk])
        g.remove([e for i, e in enumerate(g.entries) if i not in taken])
        g.last_cut = now
        if not g.entries:
            del self._groups[(g.priority, g.key)]
        return batch
