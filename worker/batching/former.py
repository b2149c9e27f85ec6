"""BatchFormer: cross-request batching by token cost for one model (the standalone path).

Units (tokenised items) from concurrent requests queue under a batch key; items with equal keys
(same op, outputs, instruction, query flag, LoRA, options) may share a forward pass. A key flushes
when its pending cost or count reaches the cap, when its oldest unit has waited ``max_wait_ms``, or
when nothing new arrived for ``coalesce_ms``. Pending units are sorted by cost and cut into chunks
under the caps, so each forward pass pads only to its own longest unit (a model whose forward runs
packed, without padding, gets chunks cut by total tokens instead of length bands); the chunk
holding the oldest unit runs first, so long units are never starved by a stream of short ones.

Priority classes (``X-SIE-Priority`` on ``sie serve``, the same rules as the sidecar's): queues are
keyed by class too. Of the queues due to flush, interactive ones go first (oldest head first), then
bulk; a bulk queue that has waited ``bulk_max_wait_ms`` for its next batch (since its oldest unit
arrived or its last batch was cut, whichever is later) ranks like an interactive one that arrived
then, so bulk is never starved, and a bulk backlog never ranks above the interactive work that
arrives while it is worked through. At most one bulk batch is in flight at a time, and while
interactive work arrived within ``bulk_mixed_window_s`` bulk chunks hold at most
``bulk_mixed_requests`` units: an interactive unit waits behind at most one small bulk batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.clock import MONOTONIC, Clock
from protocol.ipc import forward_share
from protocol.priority import BULK, INTERACTIVE, PRIORITIES
from worker.adapters.base import Prepared, RequestContext


@dataclass
class BatchInfo:
    """When a forward pass ran and how big it was (shared by the units in it)."""

    started: float
    finished: float
    size: int

    @property
    def inference_ms(self) -> float:
        return (self.finished - self.started) * 1000.0


def token_counts(units: list[Prepared], packed: bool = False) -> tuple[int, int]:
    """(real tokens, pad positions) of one forward pass over ``units``: a padded pass pads every unit
    to the longest; a packed one pads nothing."""
    real = sum(u.cost for u in units)
    return real, 0 if packed else max(u.cost for u in units) * len(units) - real


@dataclass
class BatchStats:
    forwards: int = 0
    units: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0  # pad positions added to reach each batch's longest unit

    @property
    def padded_share(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def record(self, units: list[Prepared], packed: bool = False) -> tuple[int, int]:
        """Count one forward pass (``packed``: it ran without padding); returns its (real tokens,
        pad positions)."""
        real, pad = token_counts(units, packed)
        self.forwards += 1
        self.units += len(units)
        self.real_tokens += real
        self.padded_tokens += pad
        return real, pad


@dataclass
class _Pending:
    unit: Prepared
    future: asyncio.Future[tuple[Any, BatchInfo]]
    enqueued: float


@dataclass
class _Queue:
    ctx: RequestContext
    priority: str
    items: list[_Pending] = field(default_factory=list)
    last_arrival: float = 0.0
    last_cut: float = float("-inf")  # monotonic time the queue's last batch was cut

    @property
    def waiting_since(self) -> float:
        """When the queue's next batch started waiting: its oldest unit's arrival or its last cut
        (a backlog's head has waited since it arrived, its next batch only since the last one)."""
        return max(self.items[0].enqueued, self.last_cut)

    @property
    def cost(self) -> int:
        return sum(p.unit.cost for p in self.items)


RunFn = Callable[[RequestContext, list[Prepared]], Awaitable[list[Any]]]


def chunk_by_cost(
    units: list[Prepared], max_cost: int, max_count: int, max_pad_share: float = 0.2, *, packed: bool = False
) -> list[list[int]]:
    """Indices of ``units`` sorted by cost and cut into chunks.

    A chunk ends when the next unit would break the cost cap, the count cap, or make pad positions
    more than ``max_pad_share`` of the chunk's padded tokens: equal lengths share one big forward
    pass, spread-out lengths go into length bands. The cost of a padded chunk is its width × count;
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


class BatchFormer:
    def __init__(
        self,
        run: RunFn,
        *,
        max_cost: int,
        max_requests: int,
        max_wait_ms: float,
        coalesce_ms: float,
        max_pad_share: float = 0.2,
        packs: Callable[[RequestContext], bool] | None = None,
        in_flight: int = 1,
        forward_threads: int = 1,
        bulk_mixed_requests: int = 8,
        bulk_mixed_window_s: float = 2.0,
        bulk_max_wait_ms: float = 2000.0,
        name: str = "",
        clock: Clock = MONOTONIC,
    ) -> None:
        #: requests announced with ``expect()`` that have not submitted yet (still tokenising)
        self.preparing = 0
        self._run = run
        self.max_cost = max_cost
        self.max_requests = max_requests
        self.max_wait = max_wait_ms / 1000.0
        self.coalesce = coalesce_ms / 1000.0
        self.max_pad_share = max_pad_share
        self.packs = packs or (lambda ctx: False)  # whether a context's forward runs packed
        self.window = 8 * max_requests
        self.bulk_mixed_requests = max(1, min(bulk_mixed_requests, max_requests))
        self.bulk_mixed_window = bulk_mixed_window_s
        self.bulk_max_wait = bulk_max_wait_ms / 1000.0
        self.name = name
        self.clock = clock
        self._last_interactive = float("-inf")  # monotonic time of the newest interactive submit
        self._bulk_running = 0  # bulk batches handed over and not finished (at most one)
        self._queues: dict[tuple[str, tuple[Any, ...]], _Queue] = {}
        self._wakeup = asyncio.Event()
        # batches handed to the forward threads and not finished: on one forward thread (CUDA) a second is
        # already queued when a forward pass ends, so an accelerator never waits for the loop; on
        # several (CPU) each runs its own, and a queue found with threads idle is spread over them
        self.in_flight = max(1, in_flight)
        self._handed = 0  # batches handed over and not finished (at most ``in_flight``)
        self.forward_threads = max(1, forward_threads)
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False
        self._task = asyncio.create_task(self._loop(), name=f"batchformer:{name}")

    @property
    def busy(self) -> bool:
        """Requests queued or batches running: not idle."""
        return self.depth > 0 or bool(self._running) or self._handed > 0

    @property
    def depth(self) -> int:
        return sum(len(q.items) for q in self._queues.values())

    @property
    def pending_cost(self) -> int:
        return sum(q.cost for q in self._queues.values())

    def expect(self) -> None:
        """A request will submit soon (it is tokenising): worth waiting for it to join a batch."""
        self.preparing += 1

    def unexpect(self) -> None:
        """An announced request will not submit after all (its preparation failed)."""
        self.preparing -= 1
        self._wakeup.set()

    def submit(
        self,
        ctx: RequestContext,
        units: list[Prepared],
        *,
        expected: bool = False,
        priority: str = INTERACTIVE,
    ) -> list[asyncio.Future[tuple[Any, BatchInfo]]]:
        """Queue ``units`` in ``priority``'s class; ``expected`` when the request was announced with
        ``expect()``."""
        if expected:
            self.preparing -= 1
        if self._closed:
            raise RuntimeError("batch former is closed")
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        if priority == INTERACTIVE:
            self._last_interactive = now
        key = (priority, ctx.batch_key())
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(ctx, priority)
        futures = []
        for unit in units:
            fut = loop.create_future()
            queue.items.append(_Pending(unit, fut, now))
            futures.append(fut)
        queue.last_arrival = now
        self._wakeup.set()
        return futures

    async def close(self, exc: BaseException | None = None) -> None:
        """Stop; pending units fail with ``exc`` (or are cancelled)."""
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._running:
            await asyncio.wait(self._running)
        for queue in self._queues.values():
            for p in queue.items:
                if not p.future.done():
                    if exc is not None:
                        p.future.set_exception(exc)
                    else:
                        p.future.cancel()
        self._queues.clear()

    def _max_count(self, queue: _Queue, now: float) -> int:
        """Units per chunk of ``queue``: bulk chunks are small while interactive work is arriving."""
        if queue.priority == BULK and now - self._last_interactive <= self.bulk_mixed_window:
            return self.bulk_mixed_requests
        return self.max_requests

    def _due(self, queue: _Queue, now: float) -> float:
        """Seconds until ``queue`` should flush (0 = now).

        Full queues flush at once, and so does everything when no announced request is still
        tokenising: nothing could join, so waiting would only add latency. Otherwise a queue
        waits for its coalesce window or its oldest unit's deadline.
        """
        if (
            len(queue.items) >= self._max_count(queue, now)
            or queue.cost >= self.max_cost
            or self.preparing <= 0
        ):
            return 0.0
        oldest = queue.items[0].enqueued
        return max(0.0, min(oldest + self.max_wait, queue.last_arrival + self.coalesce) - now)

    def _rank(self, queue: _Queue, now: float) -> tuple[bool, float]:
        """Interactive first (oldest head first), then bulk (longest waiting for its next batch
        first); bulk that has waited ``bulk_max_wait`` ranks as interactive work that arrived when
        it started waiting (anti-starvation)."""
        if queue.priority != BULK:
            return (False, queue.items[0].enqueued)
        since = queue.waiting_since
        return (now - since < self.bulk_max_wait, since)

    def _eligible(self) -> list[_Queue]:
        """Queues a batch may come from now: bulk ones only while no bulk batch is in flight."""
        return [
            q for q in self._queues.values() if q.items and (q.priority != BULK or not self._bulk_running)
        ]

    async def _loop(self) -> None:
        """Every wait of the former goes through its clock: for a deadline, or for ``_wakeup`` (a
        submit, an unexpect, a finished batch)."""
        while True:
            self._queues = {k: q for k, q in self._queues.items() if q.items}
            eligible = self._eligible()
            # nothing pending, only bulk while a bulk batch runs, or the forward threads full: a submit or
            # the end of a batch wakes the loop
            if not eligible or self._handed >= self.in_flight:
                self._wakeup.clear()
                await self.clock.wait(self._wakeup, None)
                continue
            now = self.clock.now()
            wait = min(self._due(q, now) for q in eligible)
            if wait > 0:
                self._wakeup.clear()
                await self.clock.wait(self._wakeup, wait)
                continue
            # flush the best due queue
            queue = min((q for q in eligible if self._due(q, now) == 0.0), key=lambda q: self._rank(q, now))
            taken = self._take(queue, self._spread(queue, self._max_count(queue, now)))
            if taken is None:
                continue
            queue.last_cut = now
            bulk = queue.priority == BULK
            self._bulk_running += bulk
            self._handed += 1
            task = asyncio.create_task(self._execute(*taken, bulk=bulk))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _spread(self, queue: _Queue, max_count: int) -> int:
        """Units for the next batch: with several forward threads idle, an equal share of the queue each."""
        return forward_share(len(queue.items), self.forward_threads - self._handed, max_count)

    def _take(self, queue: _Queue, max_count: int) -> tuple[RequestContext, list[_Pending]] | None:
        """Remove the chunk (at most ``max_count`` units) holding the queue's oldest live unit; None
        when all were cancelled."""
        live = [p for p in queue.items if not p.future.done()]  # cancelled requests drop out here
        if not live:
            queue.items = []
            return None
        # bands are cut among the oldest units only: sorting a deep queue on every flush would
        # cost the event loop time quadratic in its depth
        window = live[: self.window]
        chunks = chunk_by_cost(
            [p.unit for p in window],
            self.max_cost,
            max_count,
            self.max_pad_share,
            packed=self.packs(queue.ctx),
        )
        chunk = next(c for c in chunks if 0 in c)  # live[0] is the oldest pending unit
        taken = set(chunk)
        queue.items = [p for i, p in enumerate(live) if i not in taken]
        return queue.ctx, [live[i] for i in chunk]

    async def _execute(self, ctx: RequestContext, batch: list[_Pending], *, bulk: bool = False) -> None:
        try:
            started = self.clock.now()
            try:
                outputs = await self._run(ctx, [p.unit for p in batch])
            except Exception as exc:  # the whole batch shares the failure
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                return
            info = BatchInfo(started, self.clock.now(), len(batch))
            for p, out in zip(batch, outputs, strict=True):
                if not p.future.done():
                    p.future.set_result((out, info))
        finally:
            self._bulk_running -= bulk
            self._handed -= 1
            self._wakeup.set()
