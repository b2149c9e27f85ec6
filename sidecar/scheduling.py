"""Per-model scheduling: one task per model spec forms batches and runs them on the worker (RunBatch).

:class:`Scheduler` takes deliveries from intake (:meth:`Scheduler.submit`), queues them per model
by (operation, group key, priority class), cuts batches by the cluster's one batching policy
(:mod:`protocol.batching`, which ``sie serve``'s BatchFormer runs too) and runs them. It sees the worker through :class:`BatchRunner`, model
readiness through :class:`ModelReadiness` (EnsureModelReady before a model's first batch and after a
worker restart), and settles through :class:`BatchSettler`; time comes from a
:class:`protocol.clock.Clock`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import nats.js.errors

from iokit.payloads import PayloadReader
from protocol import ipc, tracing
from protocol.batching import Load
from protocol.clock import Clock
from protocol.errors import ErrorCode
from protocol.subjects import BULK, INTERACTIVE
from protocol.work import WorkResult
from protocol.work_codec import WorkCodec
from sidecar.deliveries import Delivery, ModelScheduler
from sidecar.ipc_client import IpcRemoteError, IpcTransportError
from sidecar.metrics import SidecarMetrics
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar")


class BatchRunner(Protocol):
    """RunBatch on the worker (:class:`sidecar.worker_link.WorkerLink`)."""

    @property
    def generation(self) -> int: ...

    async def run_batch(
        self, request: ipc.RunBatchRequest, timeout_s: float, traceparent: str | None
    ) -> dict[str, list[ipc.ItemOutcome]]: ...


class ModelReadiness(Protocol):
    """:class:`sidecar.readiness.Readiness`, as the scheduler uses it."""

    async def ensure_ready(self, sched: ModelScheduler) -> bool: ...

    def transport_nak_delay(self) -> float: ...


class BatchSettler(Protocol):
    """:class:`sidecar.settlement.Settlement`, as the scheduler uses it."""

    async def ack(self, d: Delivery, *, drop: bool = False) -> None: ...

    async def nak(self, d: Delivery, delay_s: float) -> None: ...

    async def settle(self, sched: ModelScheduler, d: Delivery, outcome: ipc.ItemOutcome) -> None: ...

    def goes_with_others(self, d: Delivery, outcome: ipc.ItemOutcome) -> bool: ...

    async def publish_together(self, results: list[tuple[Delivery, bytes, bool]]) -> None: ...

    def error_result(self, d: Delivery, code: str, message: str) -> WorkResult: ...

    async def publish_and_ack(
        self, d: Delivery, result: WorkResult | bytes, *, success: bool = False
    ) -> None: ...


class SharedGate(Protocol):
    """Held shared by every batch on the worker (:class:`sidecar.barrier.ExecutionBarrier`)."""

    def shared(self) -> AbstractAsyncContextManager[None]: ...


async def cancel_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel and wait, bounded: on Python 3.11 ``wait_for`` can swallow a cancel that races with
    a result, so every loop also checks the stop flag and this wait never hangs shutdown."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)


class Scheduler:
    def __init__(
        self,
        settings: SidecarSettings,
        *,
        worker: BatchRunner,
        readiness: ModelReadiness,
        settlement: BatchSettler,
        payloads: PayloadReader,
        barrier: SharedGate,
        tombstones: Container[str],
        metrics: SidecarMetrics,
        stats: dict[str, int],
        stopping: asyncio.Event,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.worker = worker
        self.readiness = readiness
        self.settlement = settlement
        self.payloads = payloads  # the bodies of work items too large for a message
        self.barrier = barrier
        self.tombstones = tombstones
        self.metrics = metrics
        self.stats = stats
        self.stopping = stopping  # set: flush what is pending at once, end each model's task when empty
        self.clock = clock
        self.schedulers: dict[str, ModelScheduler] = {}
        self.inflight_batches = 0
        self.saturated = False
        self._slots = asyncio.Semaphore(settings.max_concurrent_batches)
        self._tasks: set[asyncio.Task[None]] = set()  # batches, and work spawned to run beside them

    # ------------------------------------------------------------------ intake's side
    def submit(self, deliveries: list[Delivery]) -> bool:
        """Queue the items of one message (one model, one priority class) on their batchers; False
        (nothing queued) when that model's queue of their class is full, unless half of the
        message's deliveries are spent already."""
        first = deliveries[0]
        sched = self._scheduler(first.spec)
        cap = max(1, sched.limits.max_requests) * self.settings.max_concurrent_batches * 2
        # per class: a bulk backlog never turns interactive work away
        if sched.pending_count(first.priority) >= cap and first.num_delivered < max(
            2, self.settings.max_deliver // 2
        ):
            return False
        for d in deliveries:
            d.cost = sched.cost_of(d.estimate)
            sched.add(d)
        sched.wake.set()
        return True

    async def cancel(self, request_id: str) -> None:
        """ACK-drop what is queued of a cancelled request (a batch already cut drops it before RunBatch)."""
        for sched in self.schedulers.values():
            for d in sched.queue.remove(lambda e: e.route.request_id == request_id):
                await self.settlement.ack(d, drop=True)

    # ------------------------------------------------------------------ the lane's side
    def queue_depth(self) -> int:
        return sum(s.pending_count() for s in self.schedulers.values())

    def pending_cost(self) -> int:
        return sum(s.pending_cost() for s in self.schedulers.values())

    def unready_all(self) -> None:
        """Every model needs EnsureModelReady again before its next batch (the worker restarts)."""
        for sched in self.schedulers.values():
            sched.ready = False

    async def give_back_queued(self, delay_s: Callable[[], float]) -> None:
        """NAK everything queued (not yet in a batch), each with the delay ``delay_s()`` says then."""
        for sched in self.schedulers.values():
            for d in sched.take_all():
                await self.settlement.nak(d, delay_s())
            sched.wake.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` beside the batches: :meth:`finish` waits for it as for them."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self, budget_s: float) -> None:
        """Wait up to ``budget_s`` for the batches running, then end every model's task."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=budget_s)
        await cancel_and_wait([sched.task for sched in self.schedulers.values() if sched.task])

    # ------------------------------------------------------------------ scheduling
    def _scheduler(self, spec: str) -> ModelScheduler:
        sched = self.schedulers.get(spec)
        if sched is None:
            sched = ModelScheduler(spec=spec, limits=self.settings.batch_limits())
            self.schedulers[spec] = sched
            sched.task = asyncio.create_task(self._run_scheduler(sched), name=f"sidecar-sched-{spec}")
        return sched

    async def _run_scheduler(self, sched: ModelScheduler) -> None:
        while not (self.stopping.is_set() and sched.pending_count() == 0):
            if sched.pending_count() == 0:
                sched.wake.clear()
                await sched.wake.wait()
                continue
            needs_ensure = not sched.ready or sched.generation != self.worker.generation
            if needs_ensure and not await self.readiness.ensure_ready(sched):
                continue
            await self._slots.acquire()
            handed_off = False
            try:
                batch = None
                while True:
                    now = self.clock.now()
                    load = self._load(sched)
                    batch = sched.queue.next_batch(now, load)
                    if batch is not None:
                        break
                    due = sched.queue.due_at(now, load)
                    if due is None and sched.pending_count() > 0:
                        # what is pending may not go to the worker yet (it holds as many batches
                        # as it takes): wait for one to finish
                        sched.wake.clear()
                        await sched.wake.wait()
                        continue
                    if due is None:
                        break
                    sched.wake.clear()
                    await self.clock.wait(sched.wake, max(0.0, due - now))
                if batch is None:
                    continue
                for d in batch.items:
                    d.in_flight = True
                sched.running += 1
                bulk = batch.priority == BULK
                sched.bulk_running += bulk
                task = asyncio.create_task(self._run_batch(sched, batch.items, bulk))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                handed_off = True
            finally:
                if not handed_off:
                    self._slots.release()

    def _load(self, sched: ModelScheduler) -> Load:
        """The worker's load for ``sched``'s model, as the batching policy weighs it. Interactive
        batches count against the worker's depth (its forwards in flight), so what arrives
        meanwhile waits here and joins the next batch, as it would in ``sie serve``, instead of
        queueing on the worker as many small batches cut every ``batcher_max_batch_wait_ms``;
        beyond it, ``batcher_queued_full_batches`` more go only when full, to wait on the worker
        for a forward, so it starts the next the moment one ends instead of idling while the answer
        comes here and the next batch goes there (on 2 cores, zero-cost items at 32 per request x 8
        clients: 0.63x to 0.85x ``sie serve`` with two more). A forward running no interactive batch
        gets what is pending at once (a request's items still arriving are waited for); a busy
        worker lets batches fill."""
        interactive = sched.running - sched.bulk_running
        idle = sched.concurrent_forwards - interactive
        return Load(
            running=interactive,
            bulk_running=sched.bulk_running,
            depth=sched.depth,
            idle_forwards=idle,
            flush=self.stopping.is_set() or idle > 0,
        )

    def _update_saturation(self) -> None:
        cap = max(1, self.settings.max_concurrent_batches)
        if self.inflight_batches >= 0.9 * cap:
            self.saturated = True
        elif self.inflight_batches < 0.7 * cap:
            self.saturated = False

    async def _bodies(self, live: list[Delivery]) -> dict[str, tuple[str, bytes, bytes]]:
        """Each delivery's part of a RunBatch by item id (its id, job and input as encoded): the
        message's, or from the payload store's object that the message names (iokit.payloads). An
        object that is gone or not a body fails its item; a store that does not answer leaves the
        item to a redelivery."""
        parts: dict[str, tuple[str, bytes, bytes]] = {}
        for d in live:
            item_id = d.route.work_item_id
            ref = WorkCodec.payload_ref(d.msg.headers)
            if ref is None:
                parts[item_id] = (item_id, d.shared, d.body)
                continue
            try:
                shared, (own,) = WorkCodec.split(await self.payloads.get(ref), 1)
                parts[item_id] = (item_id, shared, own)
            except (nats.js.errors.ObjectNotFoundError, ValueError) as exc:
                message = (
                    "the item's body is no longer in the payload store (its request ended)"
                    if isinstance(exc, nats.js.errors.ObjectNotFoundError)
                    else f"the item's body in the payload store is not one: {exc}"
                )
                await self.settlement.publish_and_ack(
                    d, self.settlement.error_result(d, ErrorCode.INTERNAL_ERROR, message)
                )
            except Exception as exc:  # noqa: BLE001 - the store unreachable: later, again
                log.warning("payload %s not read (%s); the item is redelivered", ref, exc)
                await self.settlement.nak(d, self.settings.nak_delay_s)
        return parts

    async def _run_batch(self, sched: ModelScheduler, batch: list[Delivery], bulk: bool = False) -> None:
        s = self.settings
        self.inflight_batches += 1
        self._update_saturation()
        on_worker = True

        def off_worker() -> None:
            """The worker has answered (or failed) this batch: the scheduler may send the next one
            now, while this one's results are still being published and acked."""
            nonlocal on_worker
            if on_worker:
                on_worker = False
                sched.running -= 1
                sched.bulk_running -= bulk
                sched.wake.set()

        try:
            live = []
            for d in batch:
                if d.route.request_id in self.tombstones:
                    await self.settlement.ack(d, drop=True)
                else:
                    live.append(d)
            if not live:
                return
            parts = await self._bodies(live)
            live = [d for d in live if d.route.work_item_id in parts]
            if not live:
                return
            self.stats["batches"] += 1
            dispatched = time.time()
            request = WorkCodec.run_batch(
                sched.spec,
                [parts[d.route.work_item_id] for d in live],
                worker_id=s.worker_id,
                priority=BULK if bulk else INTERACTIVE,
            )
            timeout = s.ipc_request_timeout_s
            deadlines = [d.route.deadline for d in live if d.route.deadline is not None]
            if deadlines:
                timeout = min(180.0, max(timeout, max(deadlines) - time.time()))
            self.metrics.batch_size.labels(sched.spec).observe(len(live))
            if tracing.enabled():
                for d in live:
                    tracing.record(
                        "sidecar.batch_formation",
                        parent=d.route.traceparent,
                        start_s=d.received_wall,
                        end_s=dispatched,
                        attributes={"batch_size": len(live)},
                    )
            try:
                # one span per batch: a child of its first item's request, linked to the others'
                with tracing.span(
                    "sidecar.run_batch",
                    parent=live[0].route.traceparent,
                    links=[d.route.traceparent for d in live[1:] if isinstance(d.route.traceparent, str)]
                    if tracing.enabled()
                    else (),
                    attributes={"model": sched.spec, "batch_size": len(live)},
                ):
                    async with self.barrier.shared():
                        by_id = await self.worker.run_batch(request, timeout, tracing.traceparent())
                self.metrics.run_batch_seconds.labels(sched.spec).observe(time.time() - dispatched)
            except IpcTransportError as exc:
                off_worker()
                log.warning("RunBatch of %d items for %s failed: %s", len(live), sched.spec, exc)
                sched.ready = False
                delay = self.readiness.transport_nak_delay()
                for d in live:
                    await self.settlement.nak(d, delay)
                return
            except IpcRemoteError as exc:
                off_worker()
                delay = s.overflow_nak_delay_s if exc.code == ipc.IPC_DRAINING else s.nak_delay_s
                log.warning("worker refused RunBatch for %s: %s", sched.spec, exc)
                for d in live:
                    await self.settlement.nak(d, delay)
                return
            off_worker()
            together: list[tuple[Delivery, bytes, bool]] = []  # results that share a message
            for d in live:
                queue = by_id.get(d.route.work_item_id)
                if not queue:
                    log.warning("no outcome for %s", d.route.work_item_id)
                    await self.settlement.nak(d, s.nak_delay_s)
                    continue
                outcome = queue.pop(0)
                if outcome.input_tokens is not None:
                    sched.learn(d.estimate, outcome.input_tokens)
                if self.settlement.goes_with_others(d, outcome) and outcome.result is not None:
                    together.append((d, outcome.result, outcome.disposition == ipc.PUBLISH_AND_ACK))
                else:
                    await self.settlement.settle(sched, d, outcome)
            await self.settlement.publish_together(together)
        finally:
            off_worker()
            self.inflight_batches -= 1
            self._update_saturation()
            self._slots.release()
            sched.wake.set()
