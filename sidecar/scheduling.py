"""Per-model scheduling: one task per model spec forms batches and runs them over IPC (RunBatch)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from protocol import ipc, tracing
from protocol.subjects import BULK
from sidecar.batcher import Batcher, BatchLimits, next_due, oldest_ready
from sidecar.deliveries import Delivery, ModelScheduler
from sidecar.ipc_client import IpcRemoteError, IpcTransportError
from sidecar.liveness import Liveness

log = logging.getLogger("sie.sidecar")


class Scheduling(Liveness):
    def _scheduler(self, spec: str) -> ModelScheduler:
        sched = self.schedulers.get(spec)
        if sched is None:
            s = self.settings
            sched = ModelScheduler(
                spec=spec,
                limits=BatchLimits(
                    max_cost=s.batcher_max_batch_cost or s.batcher_default_batch_cost,
                    max_requests=s.batcher_max_batch_requests,
                    max_wait_s=s.batcher_max_batch_wait_ms / 1000.0,
                    gather_s=s.batcher_gather_ms / 1000.0,
                ),
            )
            self.schedulers[spec] = sched
            sched.task = asyncio.create_task(self._run_scheduler(sched), name=f"sidecar-sched-{spec}")
        return sched

    # ------------------------------------------------------------------ scheduling
    async def _run_scheduler(self, sched: ModelScheduler) -> None:
        while not (self._stop.is_set() and sched.pending_count() == 0):
            if sched.pending_count() == 0:
                sched.wake.clear()
                await sched.wake.wait()
                continue
            needs_ensure = not sched.ready or sched.generation != self.ipc.generation
            if needs_ensure and not await self._ensure_ready(sched):
                continue
            await self._batch_slots.acquire()
            handed_off = False
            try:
                batcher = None
                while True:
                    await self._drop_cancelled(sched)
                    now = time.monotonic()
                    batchers = self._eligible(sched)
                    # a worker with an idle lane (no interactive batch on it) gets what is pending at
                    # once (a request's items still arriving are waited for); a busy one lets batches fill
                    flush_now = self.draining or self._idle_lanes(sched) > 0
                    batcher = oldest_ready(
                        batchers, now, sched.limits, flush_now=flush_now,
                        bulk_after_s=self.settings.bulk_max_wait_ms / 1000.0,
                    )  # fmt: skip
                    if batcher is not None:
                        break
                    due = next_due(batchers, sched.limits, now, flush_now=flush_now)
                    if due is None and sched.pending_count() > 0:
                        # what is pending may not go to the worker yet (it holds as many batches
                        # as it takes): wait for one to finish
                        sched.wake.clear()
                        await sched.wake.wait()
                        continue
                    if due is None:
                        break
                    sched.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sched.wake.wait(), max(0.0, due - now))
                if batcher is None:
                    continue
                limits = sched.limits
                if batcher.priority == BULK:  # small bulk batches: an interactive one waits for at most one
                    limits = dataclasses.replace(
                        limits, max_requests=min(limits.max_requests, self._bulk_cap(sched))
                    )
                else:  # with several lanes idle, an equal share for each (ipc.lane_share)
                    share = ipc.lane_share(len(batcher), self._idle_lanes(sched), limits.max_requests)
                    limits = dataclasses.replace(limits, max_requests=share)
                batch = batcher.take(limits)
                if not batch:
                    continue
                for d in batch:
                    d.in_flight = True
                sched.running += 1
                bulk = batcher.priority == BULK
                sched.bulk_running += bulk
                task = asyncio.create_task(self._run_batch(sched, batch, bulk))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)
                handed_off = True
            finally:
                if not handed_off:
                    self._batch_slots.release()

    @staticmethod
    def _idle_lanes(sched: ModelScheduler) -> int:
        """The worker's forward lanes for this model that run no interactive batch now."""
        return sched.lanes - (sched.running - sched.bulk_running)

    def _bulk_cap(self, sched: ModelScheduler) -> int:
        """Items per bulk batch: the mixed size while interactive work of this model is arriving (the
        next interactive item waits behind at most that), else the full bulk size."""
        s = self.settings
        mixed = time.monotonic() - sched.last_interactive <= s.bulk_mixed_window_s
        return (
            min(s.bulk_mixed_batch_requests, s.bulk_max_batch_requests)
            if mixed
            else s.bulk_max_batch_requests
        )

    def _eligible(self, sched: ModelScheduler) -> list[Batcher]:
        """The batchers a batch may come from now: bulk ones only while fewer than
        ``bulk_max_concurrent_batches`` bulk batches of the model are on the worker, so an interactive
        batch never queues there behind more bulk work than that; interactive ones only while fewer
        interactive batches than the worker's depth (its forwards in flight) are there, so what
        arrives meanwhile waits here and joins the next batch, as it would in ``sie serve``, instead
        of queueing on the worker as many small batches cut every ``batcher_max_batch_wait_ms``."""
        bulk_ok = sched.bulk_running < self.settings.bulk_max_concurrent_batches
        interactive_ok = not sched.depth or sched.running - sched.bulk_running < sched.depth
        return [b for b in sched.batchers.values() if (bulk_ok if b.priority == BULK else interactive_ok)]

    async def _drop_cancelled(self, sched: ModelScheduler) -> None:
        for b in sched.batchers.values():
            for d in b.remove(lambda e: e.route.request_id in self.tombstones):
                await self._ack(d, drop=True)

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
                    await self._ack(d, drop=True)
                else:
                    live.append(d)
            if not live:
                return
            self.stats["batches"] += 1
            dispatched = time.time()
            request = ipc.RunBatchRequest(
                model_id=sched.spec,
                items=[d.msg.data for d in live],
                worker_id=s.worker_id,
                item_ids=[d.route.work_item_id for d in live],
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
                        body = await self.ipc.call(
                            ipc.RUN_BATCH,
                            request.to_map(),
                            timeout_s=timeout,
                            traceparent=tracing.traceparent(),
                        )
                self.metrics.run_batch_seconds.labels(sched.spec).observe(time.time() - dispatched)
            except IpcTransportError as exc:
                off_worker()
                log.warning("RunBatch of %d items for %s failed: %s", len(live), sched.spec, exc)
                sched.ready = False
                delay = self._transport_nak_delay()
                for d in live:
                    await self._nak(d, delay)
                return
            except IpcRemoteError as exc:
                off_worker()
                delay = s.overflow_nak_delay_s if exc.code == ipc.IPC_DRAINING else s.nak_delay_s
                log.warning("worker refused RunBatch for %s: %s", sched.spec, exc)
                for d in live:
                    await self._nak(d, delay)
                return
            off_worker()
            outcomes = body.get("outcomes") if isinstance(body, dict) else None
            by_id: dict[str, list[dict[str, Any]]] = {}
            for out in outcomes if isinstance(outcomes, list) else []:
                if isinstance(out, dict):
                    by_id.setdefault(str(out.get("work_item_id")), []).append(out)
            together: list[tuple[Delivery, bytes, bool]] = []  # results that share a message
            for d in live:
                queue = by_id.get(d.route.work_item_id)
                if not queue:
                    log.warning("no outcome for %s", d.route.work_item_id)
                    await self._nak(d, s.nak_delay_s)
                    continue
                outcome = queue.pop(0)
                tokens = outcome.get("input_tokens")
                if isinstance(tokens, int):
                    sched.learn(d.estimate, tokens)
                if self._goes_with_others(d, outcome):
                    together.append((d, outcome["result"], outcome["disposition"] == ipc.PUBLISH_AND_ACK))
                else:
                    await self._settle(sched, d, outcome)
            await self._publish_together(together)
        finally:
            off_worker()
            self.inflight_batches -= 1
            self._update_saturation()
            self._batch_slots.release()
            sched.wake.set()
