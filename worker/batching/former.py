"""BatchFormer: cross-request batching by token cost for one model (the standalone path).

Units (tokenised items) from concurrent requests queue under a batch key (same op, outputs,
instruction, query flag, LoRA, options: units that may share a forward pass) and a priority class
(``X-SIE-Priority`` on ``sie serve``). When a batch is due and which units it holds is the
cluster's one batching policy, :mod:`protocol.batching` (the sidecar's scheduler runs the same):
interactive before bulk, bulk caps and anti-starvation, count and cost limits, the wait and
coalesce windows. Here, ``load.flush`` is "no announced request is still tokenising" (nothing could
join, so waiting would only add latency), and each batch is cut into length bands
(``max_pad_share``) unless its context's forward runs packed. The former keeps the I/O: futures,
the forward threads, and at most ``in_flight`` batches handed to them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from protocol.batching import BatchLimits, BatchQueue, Load
from protocol.clock import MONOTONIC, Clock
from protocol.priority import BULK, INTERACTIVE
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


RunFn = Callable[[RequestContext, list[Prepared]], Awaitable[list[Any]]]


class BatchFormer:
    def __init__(
        self,
        run: RunFn,
        *,
        limits: BatchLimits,
        packs: Callable[[RequestContext], bool] | None = None,
        in_flight: int = 1,
        forward_threads: int = 1,
        name: str = "",
        clock: Clock = MONOTONIC,
    ) -> None:
        """``limits``: the policy's (:meth:`worker.settings.WorkerSettings.batch_limits`);
        ``packs(ctx)``: whether a context's forward runs packed (cut by total tokens, no bands)."""
        #: requests announced with ``expect()`` that have not submitted yet (still tokenising)
        self.preparing = 0
        self._run = run
        self.limits = limits
        self.name = name
        self.clock = clock
        packs_ctx = packs or (lambda ctx: False)
        self._contexts: dict[Hashable, RequestContext] = {}  # batch key -> a context of that key
        self._queue: BatchQueue[_Pending] = BatchQueue(
            limits, packs=lambda key: packs_ctx(self._contexts[key])
        )
        self._bulk_running = 0  # bulk batches handed over and not finished
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
        return len(self._queue)

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
        """Queue ``units`` in ``priority``'s class (ValueError for an unknown one); ``expected``
        when the request was announced with ``expect()``."""
        if expected:
            self.preparing -= 1
        if self._closed:
            raise RuntimeError("batch former is closed")
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        key = ctx.batch_key()
        self._contexts.setdefault(key, ctx)
        futures = []
        for unit in units:
            fut: asyncio.Future[tuple[Any, BatchInfo]] = loop.create_future()
            self._queue.append(_Pending(unit, fut), group=key, cost=unit.cost, arrived=now, priority=priority)
            futures.append(fut)
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
        for p in self._queue.remove(lambda p: True):
            if not p.future.done():
                if exc is not None:
                    p.future.set_exception(exc)
                else:
                    p.future.cancel()

    def _load(self) -> Load:
        return Load(
            running=self._handed,
            bulk_running=self._bulk_running,
            idle_forwards=self.forward_threads - self._handed,
            flush=self.preparing <= 0,
        )

    async def _loop(self) -> None:
        """Every wait of the former goes through its clock: for a deadline, or for ``_wakeup`` (a
        submit, an unexpect, a finished batch)."""
        while True:
            self._queue.remove(lambda p: p.future.done())  # cancelled requests drop out here
            keys = self._queue.groups()
            self._contexts = {k: c for k, c in self._contexts.items() if k in keys}
            now = self.clock.now()
            load = self._load()
            # the forward threads full, nothing pending, or only bulk while a bulk batch runs: a
            # submit or the end of a batch wakes the loop
            due = self._queue.due_at(now, load) if self._handed < self.in_flight else None
            batch = self._queue.next_batch(now, load) if due is not None and due <= now else None
            if batch is None:
                self._wakeup.clear()
                await self.clock.wait(self._wakeup, None if due is None else due - now)
                continue
            bulk = batch.priority == BULK
            self._bulk_running += bulk
            self._handed += 1
            task = asyncio.create_task(self._execute(self._contexts[batch.group], batch.items, bulk=bulk))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

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
