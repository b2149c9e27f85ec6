"""The state a lane consumer's parts share: settings, clients, held deliveries, schedulers, counters.

The lane consumer is built in layers, each in its own module with one job, each a subclass of the
one below: :class:`LaneState` (this module) → settlement → readiness → liveness → scheduling →
intake → :class:`sidecar.lane.LaneConsumer` (lifecycle).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from protocol import ipc
from protocol.subjects import BULK, INTERACTIVE, lane_prefix
from sidecar.barrier import ExecutionBarrier
from sidecar.deliveries import Delivery, ModelScheduler
from sidecar.ipc_client import IpcClient
from sidecar.metrics import SidecarMetrics
from sidecar.puller import Puller
from sidecar.settings import SidecarSettings
from sidecar.tombstones import Tombstones


class WorkerHealth:
    """What the last Pings said about the worker."""

    def __init__(self) -> None:
        self.last_ok: float | None = None  # monotonic
        self.ping: ipc.PingResponse = ipc.PingResponse()

    def fresh(self, stale_after_s: float) -> bool:
        return self.last_ok is not None and time.monotonic() - self.last_ok <= stale_after_s


class ConfigView(Protocol):
    """What the lane needs of the config-delta applier (:class:`sidecar.config_sync.ConfigApplier`)."""

    unsupported_models: list[str]

    def advertised_hash(self) -> str: ...

    async def stop(self) -> None: ...


class LaneState:
    def __init__(
        self,
        nc: NATS,
        ipc_client: IpcClient,
        settings: SidecarSettings,
        *,
        barrier: ExecutionBarrier | None = None,
        worker: WorkerHealth | None = None,
        config: ConfigView | None = None,
    ) -> None:
        self.nc = nc
        # Batches hold it shared on the worker; config applies hold it exclusively.
        self.barrier = barrier or ExecutionBarrier()
        self.config = config  # None: no config deltas applied (the worker's own hash is advertised)
        self.js = nc.jetstream()
        self.ipc = ipc_client
        self.settings = settings
        self.worker = worker or WorkerHealth()
        self.tombstones = Tombstones(settings.cancel_tombstone_ttl_s)
        self.schedulers: dict[str, ModelScheduler] = {}
        self.held: set[Delivery] = set()
        self.inflight_batches = 0
        self.saturated = False
        self.stream = ""
        self.durable = ""
        self.bulk_durable = ""
        self._batch_slots = asyncio.Semaphore(settings.max_concurrent_batches)
        # per priority class: set when its pull request ends, or, while its loop waits for room
        # (``_room_wanted``), when a delivery is settled
        self._wakes: dict[str, asyncio.Event] = {INTERACTIVE: asyncio.Event(), BULK: asyncio.Event()}
        self._room_wanted: set[str] = set()
        self._stop = asyncio.Event()
        self.draining = False
        self._tasks: list[asyncio.Task] = []
        self._batch_tasks: set[asyncio.Task] = set()
        self._pullers: dict[str, Puller] = {}
        self._cancel_sub: Subscription | None = None
        self._lane_prefix = lane_prefix(settings.pool, settings.machine_profile, settings.bundle)
        # counters (observability and tests)
        self.stats: dict[str, int] = {
            "received": 0,
            "published": 0,
            "acked": 0,
            "naked": 0,
            "dropped": 0,
            "batches": 0,
            "progress": 0,
            "dead_lettered": 0,
        }
        self.metrics = SidecarMetrics(settings.pool, settings.machine_profile, settings.bundle)
        self.metrics.watch(self)
