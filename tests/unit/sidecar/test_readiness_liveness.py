"""Readiness, Liveness and Intake's pull budget, each built alone: the worker scripted at the
Readiness seam, time on a manual clock."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from protocol import ipc
from protocol.batching import BatchLimits
from protocol.errors import ErrorCode
from protocol.subjects import BULK, INTERACTIVE
from protocol.work import Heartbeat
from sidecar.deliveries import Delivery, Held, Lease, ModelScheduler
from sidecar.intake import Intake
from sidecar.ipc_client import IpcRemoteError, IpcTransportError
from sidecar.liveness import Liveness
from sidecar.metrics import SidecarMetrics
from sidecar.readiness import Readiness, WorkerHealth
from sidecar.settings import SidecarSettings
from sidecar.tombstones import Tombstones
from tests.support.clock import ManualClock
from tests.support.polling import wait_until
from tests.unit.sidecar.parts import MODEL, RecordingSettler, delivery, quiesce

SETTINGS = SidecarSettings(worker_id="w", batcher_max_batch_requests=64, batcher_default_batch_cost=16384)


class ScriptedWorker:
    """Answers Ping and EnsureModelReady from a script (a response, or an error to raise)."""

    def __init__(self, *answers: object) -> None:
        self.generation = 3
        self.answers = list(answers)
        self.ping_answer: ipc.PingResponse | Exception = ipc.PingResponse(ready=True)

    async def ping(self, timeout_s: float, pinned: list[str] | None = None) -> ipc.PingResponse:
        self.pinned_sent = pinned
        if isinstance(self.ping_answer, Exception):
            raise self.ping_answer
        return self.ping_answer

    async def ensure_model_ready(self, spec: str, timeout_s: float) -> ipc.EnsureModelReadyResponse:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, ipc.EnsureModelReadyResponse)
        return answer


def readiness(worker: ScriptedWorker, clock: ManualClock | None = None) -> tuple[Readiness, RecordingSettler]:
    settler = RecordingSettler()
    clock = clock or ManualClock()
    health = WorkerHealth()
    health.last_ok, health.ping = clock.now(), ipc.PingResponse(ready=True)
    return Readiness(worker, SETTINGS, health, settler, asyncio.Event(), clock), settler


def sched_with(*deliveries: Delivery) -> ModelScheduler:
    s = ModelScheduler(spec=MODEL, limits=BatchLimits(max_cost=1, max_requests=1, max_wait_s=0.01))
    for d in deliveries:
        s.add(d)
    return s


# ----------------------------------------------------------------------------- readiness


async def test_a_ready_model_takes_the_workers_limits():
    r, _ = readiness(
        ScriptedWorker(
            ipc.EnsureModelReadyResponse(
                state=ipc.STATE_READY,
                max_batch_tokens=2048,
                batch_budget=16,
                forwards_in_flight=2,
                forward_lanes=2,
            )
        )
    )
    s = sched_with()
    assert await r.ensure_ready(s)
    assert s.ready and s.generation == 3
    assert (s.limits.max_cost, s.limits.max_requests, s.depth, s.concurrent_forwards) == (2048, 16, 2, 2)


async def test_a_loading_model_keeps_its_items_leased_and_rechecks_on_the_clock():
    clock = ManualClock()
    r, settler = readiness(
        ScriptedWorker(ipc.EnsureModelReadyResponse(state=ipc.STATE_LOADING_STARTED)), clock
    )
    d = delivery(clock.now())
    s = sched_with(d)
    check = asyncio.create_task(r.ensure_ready(s))
    await quiesce()
    assert not check.done() and settler.done == [("progress", d.msg.data)]
    clock.advance(SETTINGS.model_loading_recheck_s)
    assert await check is False
    assert s.pending() == [d] and not s.ready  # still queued, nothing spent


async def test_a_failed_load_answers_every_item():
    r, settler = readiness(
        ScriptedWorker(ipc.EnsureModelReadyResponse(state=ipc.STATE_FAILED, error="no weights"))
    )
    ds = [delivery(0.0) for _ in range(2)]
    assert not await r.ensure_ready(sched_with(*ds))
    assert settler.actions(f"publish {ErrorCode.MODEL_LOAD_FAILED}") == [d.route.work_item_id for d in ds]


async def test_ensure_failures_nak_with_the_delay_each_calls_for():
    gone = IpcTransportError("connection refused")
    draining = IpcRemoteError("draining", code=ipc.IPC_DRAINING)
    busy = ipc.EnsureModelReadyResponse(state="retry_later")
    r, settler = readiness(ScriptedWorker(gone, draining, busy))
    r.health.last_ok = None  # the worker is gone: long enough for the pull in flight to expire
    for expected in (
        SETTINGS.nats_fetch_timeout_s + 0.25,
        SETTINGS.overflow_nak_delay_s,
        SETTINGS.nak_delay_s,
    ):
        d = delivery(0.0)
        assert not await r.ensure_ready(sched_with(d))
        assert settler.done[-1] == (f"nak {expected}", d.route.work_item_id)


async def test_ready_needs_a_fresh_ready_ping_and_no_stop():
    r, _ = readiness(ScriptedWorker())
    assert r.ready
    r.health.ping = ipc.PingResponse(ready=False)
    assert not r.ready
    r.health.ping = ipc.PingResponse(ready=True)
    r.health.forget()
    assert not r.ready and not r.fresh()
    r.health.last_ok, r.health.ping = r.clock.now(), ipc.PingResponse(ready=True)
    r.clock.advance(r.stale_after_s + 0.001)  # no Ping answered for too long
    assert not r.ready
    r.health.last_ok = r.clock.now()
    r.stopping.set()
    assert not r.ready


async def test_the_ping_loop_announces_each_change_of_readiness():
    clock = ManualClock()
    worker = ScriptedWorker()
    r, _ = readiness(worker, clock)
    r.health.forget()
    announced: list[bool] = []

    async def announce() -> None:
        announced.append(r.ready)

    interval = SETTINGS.worker_ping_interval_ms / 1000.0
    loop = asyncio.create_task(r.ping_loop(announce))
    try:
        await wait_until(lambda: announced == [True], what="ready announced")
        clock.advance(interval)  # the next Ping says the same: nothing to announce
        await quiesce()
        worker.ping_answer = ipc.PingResponse(ready=False)
        clock.advance(interval)
        await wait_until(lambda: announced == [True, False], what="not ready announced")
        worker.ping_answer = IpcTransportError("gone")
        for _ in range(10):  # failed Pings: ready stays false until the last answer goes stale
            clock.advance(interval)
            await quiesce()
        assert announced == [True, False]
        worker.ping_answer = ipc.PingResponse(ready=True)
        clock.advance(interval)
        await wait_until(lambda: announced == [True, False, True], what="ready again")
    finally:
        r.stopping.set()
        await loop


# ----------------------------------------------------------------------------- liveness


class Load:
    inflight_batches = 2
    saturated = True

    def queue_depth(self) -> int:
        return 5

    def pending_cost(self) -> int:
        return 50


class Config:
    unsupported_models = ["m-x"]

    def advertised_hash(self) -> str:
        return "verified"

    async def stop(self) -> None:
        pass


class Leases:
    """Renews as Settlement does: stamps the lease on the clock."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.renewed: list[str] = []

    async def progress(self, lease: Lease) -> None:
        lease.last_progress = self.clock.now()
        self.renewed.append(lease)


def liveness(clock: ManualClock, *, config: Config | None = None) -> tuple[Liveness, Readiness, Held, Leases]:
    r, _ = readiness(ScriptedWorker(), clock)
    held, leases = Held(), Leases(clock)
    live = Liveness(
        NATS(),
        SETTINGS,
        worker=r,
        load=Load(),
        config=config,
        held=held,
        leases=leases,
        stopping=r.stopping,
        clock=clock,
    )
    return live, r, held, leases


async def test_a_heartbeat_says_what_the_parts_know():
    live, r, _, _ = liveness(ManualClock(), config=Config())
    r.health.ping = ipc.PingResponse(ready=True, bundle_config_hash="worker's", loaded_models=["m"])
    beat = live.heartbeat()
    assert (beat.name, beat.ready, beat.terminated) == ("w", True, False)
    assert beat.bundle_config_hash == "verified" and beat.unsupported_models == ["m-x"]
    assert (beat.queue_depth, beat.pending_cost, beat.inflight_batches, beat.saturated) == (5, 50, 2, True)
    assert beat.loaded_models == ["m"]
    last = live.heartbeat(terminated=True)
    assert last.terminated and not last.ready
    live.config = None  # no config deltas applied: the worker's own hash
    assert live.heartbeat().bundle_config_hash == "worker's"
    assert beat.gpu_count == 1
    live.settings = SETTINGS.model_copy(update={"process_index": 2})  # a pod's third model process
    assert live.heartbeat().gpu_count == 0  # the pod's device is counted once, by its first


async def test_leases_are_renewed_every_progress_interval_while_the_worker_answers():
    clock = ManualClock()
    live, r, held, leases = liveness(clock)
    interval = SETTINGS.progress_interval_s
    old, new = delivery(clock.now()), delivery(clock.now() + interval / 2)
    sibling = delivery(clock.now())  # another item of the older one's message: one renewal for both
    sibling.lease = old.lease
    old.lease.open = 2
    for d in (old, sibling, new):
        held.add(d)
    loop = asyncio.create_task(live.progress_loop())
    try:
        await quiesce()
        clock.advance(interval / 2)
        await quiesce()
        assert leases.renewed == []
        clock.advance(interval / 2)
        await wait_until(lambda: leases.renewed == [old.lease], what="the older lease renewed")
        r.health.forget()  # the worker stops answering: the leases lapse
        clock.advance(interval)
        await quiesce()
        clock.advance(interval / 2)
        await quiesce()
        assert leases.renewed == [old.lease]
    finally:
        r.stopping.set()
        await loop


# ----------------------------------------------------------------------------- intake's budget


def test_bulk_and_interactive_share_the_held_budget():
    settings = SidecarSettings(
        worker_id="w", max_held_messages=100, bulk_max_held_share=0.5, bulk_min_held_share=0.1
    )
    held = Held()
    intake = Intake(
        NATS(),
        settings,
        queue=None,  # type: ignore[arg-type]  # not reached: only the budget is asked
        worker=None,  # type: ignore[arg-type]
        settlement=None,  # type: ignore[arg-type]
        held=held,
        tombstones=Tombstones(),
        metrics=SidecarMetrics("default", "cpu", "default"),
        stats={},
        stopping=asyncio.Event(),
        clock=ManualClock(),
    )
    assert intake.free(BULK) == 50 and intake.free(INTERACTIVE) == 90
    for _ in range(50):
        held.add(delivery(0.0, priority=BULK))
    assert intake.free(BULK) == 0 and intake.free(INTERACTIVE) == 50
    for _ in range(50):
        held.add(delivery(0.0))
    assert intake.free(BULK) == 0 and intake.free(INTERACTIVE) == 0


class _Taking:
    """A queue that takes everything, and a worker that is always there: intake's other seams."""

    def __init__(self) -> None:
        self.taken: list[list[Delivery]] = []

    def submit(self, deliveries: list[Delivery]) -> bool:
        self.taken.append(deliveries)
        return True

    def fresh(self) -> bool:
        return True


async def test_a_chunk_becomes_one_delivery_per_item_and_pulls_ask_for_fewer_messages():
    from nats.aio.msg import Msg

    from protocol.codec import unpackb
    from protocol.subjects import work_subject
    from tests.support.jobs import encode_job, encode_messages

    settings = SidecarSettings(worker_id="w", max_held_messages=256)
    held, taking = Held(), _Taking()
    intake = Intake(
        NATS(),
        settings,
        queue=taking,
        worker=taking,  # type: ignore[arg-type]  # only fresh() is asked
        settlement=None,  # type: ignore[arg-type]  # not reached: nothing is refused
        held=held,
        tombstones=Tombstones(),
        metrics=SidecarMetrics("default", "cpu", "default"),
        stats={"received": 0},
        stopping=asyncio.Event(),
        clock=ManualClock(),
    )
    assert intake.messages_for(64) == 64  # nothing seen yet: one item per message
    for k in range(30):
        subject = work_subject("default", "cpu", "default", MODEL, BULK if k % 3 == 0 else INTERACTIVE)
        job = encode_job(f"r{k}", 32, model_id=MODEL, timestamp=0.0)
        # interactive: single items; bulk: chunks of 32
        [msg, *_] = encode_messages(job, ["hello"] * 32, per_message=32 if k % 3 == 0 else 1)
        await intake.intake(Msg(NATS(), subject=subject, data=msg.payload, headers=msg.headers))
    assert [len(ds) for ds in taking.taken] == [32 if k % 3 == 0 else 1 for k in range(30)]
    first = taking.taken[0]
    assert [d.route.item_index for d in first] == list(range(32)) and len({d.lease for d in first}) == 1
    assert [unpackb(d.body)["i"] for d in first] == list(range(32)) and len(
        {id(d.shared) for d in first}
    ) == 1
    assert len(held) == 10 * 32 + 20
    # after ten bulk chunks of 32 a bulk pull for 64 items asks for a few messages, not 64; the
    # interactive single items between them do not count (one average of both, about 11 items a
    # message here, had a bulk pull ask for three times the room and close the interactive pull)
    assert 2 <= intake.messages_for(64, BULK) <= 4
    assert intake.messages_for(64, INTERACTIVE) == 64


def test_pins_from_a_gateway_are_taken_only_when_well_formed():
    from sidecar.readiness import WorkerHealth

    health = WorkerHealth()
    assert health.pinned is None  # until a gateway says: the worker keeps what it has
    assert health.take_pins(b'{"models": ["sie-fake:slow-batch"]}') and health.pinned == [
        "sie-fake:slow-batch"
    ]
    for bad in (b"not json", b"[1]", b'{"models": "x"}', b'{"models": [1]}'):
        assert not health.take_pins(bad)
    assert health.pinned == ["sie-fake:slow-batch"]
    assert health.take_pins(b'{"models": []}') and health.pinned == []


class Published:
    """A HeartbeatPublisher that keeps what was published."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        self.beats.append(Heartbeat.parse(payload))


async def test_after_the_tombstone_no_live_heartbeat_is_published():
    live, r, _, _ = liveness(ManualClock())
    live.nc = out = Published()
    r.health.ping = ipc.PingResponse(ready=True)
    await live.announce()
    r.stopping.set()
    await live.publish_heartbeat(terminated=True)
    await live.announce()  # a Ping answered while stopping changes readiness: it must not follow
    assert [b.terminated for b in out.beats] == [False, True]
