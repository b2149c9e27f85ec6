"""The lane consumer: pull, validate, schedule per model, RunBatch over IPC, settle (internals 3.2–3.8).

Everything here takes its dependencies as arguments (a connected NATS client, an IpcClient, the
settings), so tests run it in-process against a real nats-server and a real worker IPC server.

Settlement (internals 3.5):

====================================================  =================================================
situation                                             action
====================================================  =================================================
success / permanent error outcome                     publish WorkResult to reply_subject, then ACK
reply publish fails                                   no ACK (redelivered after ack_wait)
reply subject not ``_INBOX.``                         ACK-drop
undecodable msgpack / malformed subject               NAK ``nak_delay_s``
unknown operation                                     error result INVALID_INPUT + ACK
model loading on the worker                           progress-ACK and recheck (no delivery spent)
retry_later, IPC transport error, missing outcome     NAK ``nak_delay_s``
worker draining                                       NAK ``overflow_nak_delay_s`` (100 ms)
over the model's held budget                          NAK 100 ms (kept instead once half the deliveries are spent)
RESOURCE_EXHAUSTED                                    NAK ``oom_nak_delay_s``, nothing published
permanent load failure                                error result MODEL_LOAD_FAILED + ACK
cancelled request                                     ACK-drop
====================================================  =================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from protocol import ipc
from protocol.codec import CodecError
from protocol.errors import ErrorCode
from protocol.subjects import (
    WORK_CANCEL_PREFIX,
    WORK_PREFIX,
    health_subject,
    is_valid_reply_subject,
    lane_token,
)
from protocol.work import OPERATIONS, Heartbeat, WorkItem, WorkResult
from sidecar.barrier import ExecutionBarrier
from sidecar.batcher import Batcher, BatchLimits, item_cost, next_due, oldest_ready
from sidecar.ipc_client import IpcClient, IpcRemoteError, IpcTransportError
from sidecar.settings import SidecarSettings
from sidecar.streams import ensure_lane_consumer, ensure_stream
from sidecar.tombstones import Tombstones, request_id_from_cancel_subject

log = logging.getLogger("sie.sidecar")

_ALWAYS_ERROR = (CodecError, ValueError, TypeError)


def model_spec(item: WorkItem) -> str:
    """The worker's model spec of an item: ``model_id`` or ``model_id:profile``."""
    profile = (item.profile_id or "").strip()
    return item.model_id if profile in ("", "default") else f"{item.model_id}:{profile}"


@dataclass(eq=False)
class Delivery:
    msg: Msg
    item: WorkItem
    spec: str
    cost: int
    arrived: float  # monotonic, for batching
    received_wall: float  # unix seconds, for queue_ms
    last_progress: float
    settled: bool = False
    in_flight: bool = False

    @property
    def lora_key(self) -> str:
        return self.item.lora or ""

    @property
    def num_delivered(self) -> int:
        try:
            return int(self.msg.metadata.num_delivered or 1)
        except Exception:  # noqa: BLE001 - a message without JetStream metadata
            return 1


@dataclass(eq=False)
class ModelScheduler:
    spec: str
    limits: BatchLimits
    batchers: dict[tuple[str, str], Batcher] = field(default_factory=dict)
    ready: bool = False
    generation: int = -1  # IPC connection generation the readiness was learned on
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def batcher(self, op: str, lora_key: str) -> Batcher:
        key = (op, lora_key)
        b = self.batchers.get(key)
        if b is None:
            b = self.batchers[key] = Batcher(op, lora_key)
        return b

    def pending(self) -> list[Delivery]:
        return [d for b in self.batchers.values() for d in b.pending]

    def pending_count(self) -> int:
        return sum(len(b) for b in self.batchers.values())

    def pending_cost(self) -> int:
        return sum(b.pending_cost for b in self.batchers.values())

    def take_all(self) -> list[Delivery]:
        out = []
        for b in self.batchers.values():
            out.extend(b.remove(lambda _e: True))
        return out


class WorkerState:
    """What the last Pings said about the worker."""

    def __init__(self) -> None:
        self.last_ok: float | None = None  # monotonic
        self.ping: ipc.PingResponse = ipc.PingResponse()

    def fresh(self, stale_after_s: float) -> bool:
        return self.last_ok is not None and time.monotonic() - self.last_ok <= stale_after_s


class LaneConsumer:
    def __init__(
        self,
        nc: NATS,
        ipc_client: IpcClient,
        settings: SidecarSettings,
        *,
        barrier: ExecutionBarrier | None = None,
    ) -> None:
        self.nc = nc
        # Batches hold it shared on the worker; config applies hold it exclusively.
        self.barrier = barrier or ExecutionBarrier()
        self.config: Any = None  # sidecar.config_sync.ConfigApplier once wired (start_sidecar)
        self.js = nc.jetstream()
        self.ipc = ipc_client
        self.settings = settings
        self.worker = WorkerState()
        self.tombstones = Tombstones(settings.cancel_tombstone_ttl_s)
        self.schedulers: dict[str, ModelScheduler] = {}
        self.held: set[Delivery] = set()
        self.inflight_batches = 0
        self.saturated = False
        self.stream = ""
        self.durable = ""
        self._batch_slots = asyncio.Semaphore(settings.max_concurrent_batches)
        self._space = asyncio.Event()
        self._space.set()
        self._stop = asyncio.Event()
        self.draining = False
        self._tasks: list[asyncio.Task] = []
        self._batch_tasks: set[asyncio.Task] = set()
        self._batch_ids = itertools.count(1)
        self._sub = None
        self._cancel_sub = None
        self._lane_prefix = (
            f"{WORK_PREFIX}.{lane_token(settings.pool)}.{lane_token(settings.machine_profile)}."
            f"{lane_token(settings.bundle)}."
        )
        # counters (observability and tests)
        self.stats: dict[str, int] = {
            "received": 0,
            "published": 0,
            "acked": 0,
            "naked": 0,
            "dropped": 0,
            "batches": 0,
            "progress": 0,
        }

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.ensure_jetstream()
        self._cancel_sub = await self.nc.subscribe(f"{WORK_CANCEL_PREFIX}.>", cb=self._on_cancel)
        self._sub = await self.js.pull_subscribe_bind(durable=self.durable, stream=self.stream)
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="sidecar-pull"),
            asyncio.create_task(self._progress_loop(), name="sidecar-progress"),
            asyncio.create_task(self._ping_loop(), name="sidecar-ping"),
            asyncio.create_task(self._heartbeat_loop(), name="sidecar-heartbeat"),
        ]

    async def ensure_jetstream(self) -> None:
        self.stream = await ensure_stream(self.js, self.settings)
        self.durable = await ensure_lane_consumer(self.js, self.stream, self.settings)

    async def stop(self, *, drain_timeout_s: float | None = None) -> None:
        """Tombstone heartbeat, stop pulling, Drain the worker, finish in-flight batches, NAK the rest."""
        if self._stop.is_set():
            return
        budget = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.draining = True
        self._stop.set()
        if self.config is not None:
            with contextlib.suppress(Exception):
                await self.config.stop()
        with contextlib.suppress(Exception):
            await self.publish_heartbeat(terminated=True)
            await self.nc.flush(timeout=2)
        await self._cancel_all(self._tasks)
        # Queued items go back at once so another pod can take them.
        for sched in self.schedulers.values():
            for d in sched.take_all():
                await self._nak(d, self.settings.overflow_nak_delay_s)
            sched.wake.set()
        with contextlib.suppress(Exception):
            await self.ipc.call(ipc.DRAIN, {"deadline_ms": int(budget * 1000)}, timeout_s=budget + 1)
        if self._batch_tasks:
            await asyncio.wait(list(self._batch_tasks), timeout=budget)
        await self._cancel_all([sched.task for sched in self.schedulers.values() if sched.task])
        for d in list(self.held):
            await self._nak(d, self.settings.overflow_nak_delay_s)
        for sub in (self._sub, self._cancel_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)

    @staticmethod
    async def _cancel_all(tasks: list[asyncio.Task]) -> None:
        """Cancel and wait, bounded: on Python 3.11 ``wait_for`` can swallow a cancel that races with
        a result, so every loop also checks the stop flag and this wait never hangs shutdown."""
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    # ------------------------------------------------------------------ pulling
    async def _pull_loop(self) -> None:
        errors = 0
        limit = max(1, self.settings.max_held_messages)
        while not self._stop.is_set():
            if not self.worker.fresh(self._worker_stale_after_s()):
                # No worker to run anything: leave the work in the stream for the lane's other pods
                # instead of pulling it only to NAK it and burn its deliveries.
                await asyncio.sleep(self.settings.worker_ping_interval_ms / 1000.0 / 2)
                continue
            free = limit - len(self.held)
            if free <= 0:
                self._space.clear()
                await self._space.wait()
                continue
            try:
                msgs = await self._sub.fetch(
                    batch=min(self.settings.nats_fetch_budget, free),
                    timeout=self.settings.nats_fetch_timeout_s,
                )
            except (nats.errors.TimeoutError, TimeoutError):
                errors = 0
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the one pull loop alive across NATS trouble
                errors += 1
                log.warning("fetch failed (%s): %s", type(exc).__name__, exc)
                await asyncio.sleep(min(5.0, 0.2 * errors))
                if errors % 5 == 0:
                    # the stream or durable may be gone (memory storage after a NATS restart)
                    try:
                        await self.ensure_jetstream()
                        self.stats["reensured"] = self.stats.get("reensured", 0) + 1
                    except Exception as ens:  # noqa: BLE001
                        log.warning("re-ensuring stream/consumer failed: %s", ens)
                continue
            errors = 0
            for msg in msgs:
                try:
                    await self.intake(msg)
                except Exception:  # noqa: BLE001 - one bad message never stops the loop
                    log.exception("intake failed")

    async def intake(self, msg: Msg) -> None:
        """Validate one delivery and queue it on its model's scheduler (or settle it right away)."""
        self.stats["received"] += 1
        now = time.monotonic()
        if not msg.subject.startswith(self._lane_prefix) or len(msg.subject.split(".")) != 6:
            log.warning("NAK message on unexpected subject %s", msg.subject)
            await self._raw_nak(msg, self.settings.nak_delay_s)
            return
        try:
            item = WorkItem.from_msgpack(msg.data)
            if (
                not isinstance(item.reply_subject, str)
                or not isinstance(item.model_id, str)
                or not item.model_id
            ):
                raise ValueError("work item lacks reply_subject or model_id")
            if not isinstance(item.options, dict):
                raise ValueError("options must be a map")
        except _ALWAYS_ERROR as exc:
            log.warning("NAK undecodable work item on %s: %s", msg.subject, exc)
            await self._raw_nak(msg, self.settings.nak_delay_s)
            return
        if not is_valid_reply_subject(item.reply_subject):
            log.warning(
                "dropping work item %s: reply subject %r is not an inbox",
                item.work_item_id,
                item.reply_subject,
            )
            await self._raw_ack(msg, drop=True)
            return
        if item.request_id in self.tombstones:
            await self._raw_ack(msg, drop=True)
            return
        d = Delivery(
            msg=msg,
            item=item,
            spec=model_spec(item),
            cost=1,
            arrived=now,
            received_wall=time.time(),
            last_progress=now,
        )
        self.held.add(d)
        if item.operation not in OPERATIONS:
            await self._publish_and_ack(
                d, self._error_result(d, ErrorCode.INVALID_INPUT, f"unknown operation {item.operation!r}")
            )
            return
        d.cost = item_cost(item.operation, item.item, item.query_item, item.score_items)
        sched = self._scheduler(d.spec)
        cap = max(1, sched.limits.max_requests) * self.settings.max_concurrent_batches * 2
        if sched.pending_count() >= cap and d.num_delivered < max(2, self.settings.max_deliver // 2):
            await self._nak(d, self.settings.overflow_nak_delay_s)
            return
        sched.batcher(item.operation, d.lora_key).add(d)
        sched.wake.set()

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
                ),
            )
            self.schedulers[spec] = sched
            sched.task = asyncio.create_task(self._run_scheduler(sched), name=f"sidecar-sched-{spec}")
        return sched

    # ------------------------------------------------------------------ cancellation
    async def _on_cancel(self, msg: Msg) -> None:
        request_id = request_id_from_cancel_subject(msg.subject)
        if not request_id:
            return
        self.tombstones.add(request_id)
        for sched in self.schedulers.values():
            for b in sched.batchers.values():
                for d in b.remove(lambda e: e.item.request_id == request_id):
                    await self._ack(d, drop=True)

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
                    batcher = oldest_ready(
                        list(sched.batchers.values()), now, sched.limits, draining=self.draining
                    )
                    if batcher is not None:
                        break
                    due = next_due(list(sched.batchers.values()), sched.limits)
                    if due is None:
                        break
                    sched.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sched.wake.wait(), max(0.0, due - now))
                if batcher is None:
                    continue
                batch = batcher.take(sched.limits)
                if not batch:
                    continue
                for d in batch:
                    d.in_flight = True
                task = asyncio.create_task(self._run_batch(sched, batcher.op, batcher.lora_key, batch))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)
                handed_off = True
            finally:
                if not handed_off:
                    self._batch_slots.release()

    async def _drop_cancelled(self, sched: ModelScheduler) -> None:
        for b in sched.batchers.values():
            for d in b.remove(lambda e: e.item.request_id in self.tombstones):
                await self._ack(d, drop=True)

    async def _ensure_ready(self, sched: ModelScheduler) -> bool:
        """EnsureModelReady for a scheduler with pending items; settles them when it cannot become ready."""
        s = self.settings
        try:
            body = await self.ipc.call(
                ipc.ENSURE_MODEL_READY, {"model_id": sched.spec}, timeout_s=s.model_ready_timeout_s
            )
            resp = ipc.EnsureModelReadyResponse.from_map(body)
        except (IpcTransportError, IpcRemoteError) as exc:
            log.warning("EnsureModelReady(%s) failed: %s", sched.spec, exc)
            delay = s.overflow_nak_delay_s if ipc.DRAINING_ERROR in str(exc) else s.nak_delay_s
            for d in sched.take_all():
                await self._nak(d, delay)
            sched.ready = False
            return False
        if resp.state == ipc.STATE_READY:
            sched.generation = self.ipc.generation
            sched.ready = True
            sched.limits.max_cost = (
                s.batcher_max_batch_cost or resp.max_batch_tokens or s.batcher_default_batch_cost
            )
            sched.limits.max_requests = min(
                s.batcher_max_batch_requests, resp.batch_budget or s.batcher_max_batch_requests
            )
            return True
        sched.ready = False
        if resp.state in (ipc.STATE_LOADING_STARTED, ipc.STATE_LOADING_IN_PROGRESS):
            for d in sched.pending():
                await self._progress(d)
            base = s.model_loading_recheck_s * (1 if resp.state == ipc.STATE_LOADING_STARTED else 2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), min(base, s.loading_recheck_cap_s))
            return False
        if resp.state == ipc.STATE_FAILED:
            code = resp.error_code or ErrorCode.MODEL_LOAD_FAILED
            message = resp.error or f"model {sched.spec} failed to load"
            for d in sched.take_all():
                await self._publish_and_ack(d, self._error_result(d, code, message))
            return False
        # retry_later
        delay = s.overflow_nak_delay_s if resp.error == ipc.DRAINING_ERROR else s.nak_delay_s
        for d in sched.take_all():
            await self._nak(d, delay)
        return False

    async def _run_batch(self, sched: ModelScheduler, op: str, lora_key: str, batch: list[Delivery]) -> None:
        s = self.settings
        self.inflight_batches += 1
        self._update_saturation()
        try:
            live = []
            for d in batch:
                if d.item.request_id in self.tombstones:
                    await self._ack(d, drop=True)
                else:
                    live.append(d)
            if not live:
                return
            self.stats["batches"] += 1
            dispatched = time.time()
            request = ipc.RunBatchRequest(
                model_id=sched.spec,
                batch_id=next(self._batch_ids),
                lora_key=lora_key,
                op=op,
                total_cost=sum(d.cost for d in live),
                items=[ipc.RunBatchRequest.item_map(d.item) for d in live],
            )
            timeout = s.ipc_request_timeout_s
            deadlines = [d.item.deadline for d in live if isinstance(d.item.deadline, (int, float))]
            if deadlines:
                timeout = min(180.0, max(timeout, max(deadlines) - time.time()))
            try:
                async with self.barrier.shared():
                    body = await self.ipc.call(ipc.RUN_BATCH, request.to_map(), timeout_s=timeout)
            except IpcTransportError as exc:
                log.warning("RunBatch of %d items for %s failed: %s", len(live), sched.spec, exc)
                sched.ready = False
                for d in live:
                    await self._nak(d, s.nak_delay_s)
                return
            except IpcRemoteError as exc:
                delay = s.overflow_nak_delay_s if ipc.DRAINING_ERROR in str(exc) else s.nak_delay_s
                log.warning("worker refused RunBatch for %s: %s", sched.spec, exc)
                for d in live:
                    await self._nak(d, delay)
                return
            outcomes = body.get("outcomes") if isinstance(body, dict) else None
            by_id: dict[str, list[dict[str, Any]]] = {}
            for out in outcomes if isinstance(outcomes, list) else []:
                if isinstance(out, dict):
                    by_id.setdefault(str(out.get("work_item_id")), []).append(out)
            for d in live:
                queue = by_id.get(d.item.work_item_id)
                if not queue:
                    log.warning("no outcome for %s", d.item.work_item_id)
                    await self._nak(d, s.nak_delay_s)
                    continue
                await self._settle(sched, d, queue.pop(0), dispatched)
        finally:
            self.inflight_batches -= 1
            self._update_saturation()
            self._batch_slots.release()
            sched.wake.set()

    async def _settle(
        self, sched: ModelScheduler, d: Delivery, outcome: dict[str, Any], dispatched: float
    ) -> None:
        s = self.settings
        disposition = outcome.get("disposition")
        if disposition in (ipc.PUBLISH_AND_ACK, ipc.PUBLISH_ERROR_AND_ACK):
            try:
                result = ipc.result_from_outcome(outcome)
            except TypeError:
                await self._nak(d, s.nak_delay_s)
                return
            result.work_item_id, result.request_id, result.item_index = (
                d.item.work_item_id,
                d.item.request_id,
                d.item.item_index,
            )
            if not result.queue_ms:
                result.queue_ms = max(0.0, (dispatched - d.received_wall) * 1000.0)
            result.worker_id = s.worker_id
            await self._publish_and_ack(d, result)
            return
        code = outcome.get("error_code")
        if code == ErrorCode.RESOURCE_EXHAUSTED:
            delay = s.oom_nak_delay_s
        else:
            delay_ms = outcome.get("nak_delay_ms")
            delay = (
                delay_ms / 1000.0 if isinstance(delay_ms, (int, float)) and delay_ms >= 0 else s.nak_delay_s
            )
        if code in (ErrorCode.MODEL_NOT_LOADED, ErrorCode.MODEL_LOADING, ErrorCode.LORA_LOADING):
            sched.ready = False  # re-ensure before the next batch
        await self._nak(d, delay)

    # ------------------------------------------------------------------ settlement primitives
    def _error_result(self, d: Delivery, code: str, message: str) -> WorkResult:
        return WorkResult(
            work_item_id=d.item.work_item_id,
            request_id=d.item.request_id,
            item_index=d.item.item_index,
            success=False,
            error=message,
            error_code=str(code),
            worker_id=self.settings.worker_id,
        )

    def _release(self, d: Delivery) -> None:
        d.settled = True
        self.held.discard(d)
        self._space.set()

    async def _publish_and_ack(self, d: Delivery, result: WorkResult) -> None:
        """Publish the result to the reply inbox, then ACK; a failed publish leaves the message un-acked."""
        if d.settled:
            return
        try:
            data = result.to_msgpack()
            try:
                await self.nc.publish(d.item.reply_subject, data)
            except nats.errors.MaxPayloadError:
                compact = self._error_result(
                    d, ErrorCode.INTERNAL_ERROR, "result larger than the NATS max payload"
                )
                await self.nc.publish(d.item.reply_subject, compact.to_msgpack())
        except Exception as exc:  # noqa: BLE001 - no ACK: JetStream redelivers after ack_wait
            log.warning("publishing result of %s failed: %s", d.item.work_item_id, exc)
            self._release(d)
            return
        self.stats["published"] += 1
        await self._ack(d)

    async def _ack(self, d: Delivery, *, drop: bool = False) -> None:
        if d.settled:
            return
        self._release(d)
        await self._raw_ack(d.msg, drop=drop)

    async def _nak(self, d: Delivery, delay_s: float) -> None:
        if d.settled:
            return
        self._release(d)
        await self._raw_nak(d.msg, delay_s)

    async def _progress(self, d: Delivery) -> None:
        if d.settled:
            return
        d.last_progress = time.monotonic()
        try:
            await d.msg.in_progress()
            self.stats["progress"] += 1
        except Exception as exc:  # noqa: BLE001
            log.debug("progress ack failed: %s", exc)

    async def _raw_ack(self, msg: Msg, *, drop: bool = False) -> None:
        self.stats["dropped" if drop else "acked"] += 1
        try:
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - redelivered later; nothing else to do
            log.warning("ack failed: %s", exc)

    async def _raw_nak(self, msg: Msg, delay_s: float) -> None:
        self.stats["naked"] += 1
        try:
            await msg.nak(delay=delay_s if delay_s > 0 else None)
        except Exception as exc:  # noqa: BLE001
            log.warning("nak failed: %s", exc)

    # ------------------------------------------------------------------ leases, ping, heartbeat
    def _worker_stale_after_s(self) -> float:
        return self.settings.worker_ping_interval_ms / 1000.0 * self.settings.worker_readyz_stale_mult

    async def _progress_loop(self) -> None:
        """Progress-ACK held deliveries about every ``progress_interval_s`` while the worker is alive.

        When the worker stops answering Pings the leases lapse, so JetStream can hand the work to
        another pod after ack_wait.
        """
        interval = self.settings.progress_interval_s
        while not self._stop.is_set():
            await asyncio.sleep(interval / 2)
            if not self.worker.fresh(self._worker_stale_after_s()):
                continue
            now = time.monotonic()
            for d in list(self.held):
                if not d.settled and now - d.last_progress >= interval:
                    await self._progress(d)

    async def _ping_loop(self) -> None:
        interval = self.settings.worker_ping_interval_ms / 1000.0
        failures = 0
        while not self._stop.is_set():
            try:
                body = await self.ipc.call(
                    ipc.PING, {"timestamp_ms": int(time.time() * 1000)}, timeout_s=max(1.0, interval)
                )
                self.worker.ping = ipc.PingResponse.from_map(body)
                self.worker.last_ok = time.monotonic()
                failures = 0
            except (IpcTransportError, IpcRemoteError) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("worker Ping failed (%d in a row): %s", failures, exc)
            await asyncio.sleep(interval)

    @property
    def ready(self) -> bool:
        return (
            not self.draining
            and self.worker.fresh(self._worker_stale_after_s())
            and bool(self.worker.ping.ready)
        )

    def queue_depth(self) -> int:
        return sum(s.pending_count() for s in self.schedulers.values())

    def pending_cost(self) -> int:
        return sum(s.pending_cost() for s in self.schedulers.values())

    def _update_saturation(self) -> None:
        cap = max(1, self.settings.max_concurrent_batches)
        if self.inflight_batches >= 0.9 * cap:
            self.saturated = True
        elif self.inflight_batches < 0.7 * cap:
            self.saturated = False

    def advertised_hash(self) -> str:
        """The last verified bundle_config_hash when config deltas are applied, else the worker's."""
        if self.config is not None:
            return self.config.advertised_hash()
        return self.worker.ping.bundle_config_hash or ""

    def heartbeat(self, *, terminated: bool = False) -> Heartbeat:
        s = self.settings
        return Heartbeat(
            name=s.worker_id,
            ready=False if terminated else self.ready,
            terminated=terminated,
            machine_profile=s.machine_profile,
            pool_name=s.pool,
            bundle=s.bundle,
            bundle_config_hash=self.advertised_hash(),
            loaded_models=list(self.worker.ping.loaded_models or []),
            queue_depth=self.queue_depth(),
            pending_cost=self.pending_cost(),
            inflight_batches=self.inflight_batches,
            saturated=self.saturated,
            unsupported_models=list(self.config.unsupported_models) if self.config is not None else [],
            timestamp=time.time(),
        )

    async def publish_heartbeat(self, *, terminated: bool = False) -> None:
        await self.nc.publish(
            health_subject(self.settings.worker_id), self.heartbeat(terminated=terminated).to_json()
        )

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.health_publish_interval_ms / 1000.0
        failures = 0
        while not self._stop.is_set():
            try:
                await self.publish_heartbeat()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - heartbeats are best effort
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("heartbeat publish failed: %s", exc)
            await asyncio.sleep(interval)
