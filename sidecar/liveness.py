"""What the sidecar says while alive: progress-ACKs that keep held leases, heartbeats to the gateways.

:class:`Liveness` reads the worker's state through :class:`WorkerView` (:class:`sidecar.readiness.Readiness`),
the lane's load through :class:`LoadView` (:class:`sidecar.scheduling.Scheduler`) and the config
applier through :class:`ConfigView`; it renews leases through :class:`LeaseKeeper`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from protocol.clock import Clock
from protocol.subjects import health_subject
from protocol.work import Heartbeat
from sidecar.deliveries import Held, Lease, leases_of
from sidecar.readiness import WorkerHealth
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar")


class HeartbeatPublisher(Protocol):
    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None: ...


class WorkerView(Protocol):
    @property
    def health(self) -> WorkerHealth: ...

    @property
    def ready(self) -> bool: ...

    def fresh(self) -> bool: ...


class LoadView(Protocol):
    @property
    def inflight_batches(self) -> int: ...

    @property
    def saturated(self) -> bool: ...

    def queue_depth(self) -> int: ...

    def pending_cost(self) -> int: ...


class ConfigView(Protocol):
    """What the lane needs of the config-delta applier (:class:`sidecar.config_sync.ConfigApplier`)."""

    unsupported_models: list[str]

    def advertised_hash(self) -> str: ...

    async def stop(self) -> None: ...


class LeaseKeeper(Protocol):
    async def progress(self, lease: Lease) -> None: ...


class Liveness:
    def __init__(
        self,
        nc: HeartbeatPublisher,
        settings: SidecarSettings,
        *,
        worker: WorkerView,
        load: LoadView,
        config: ConfigView | None,
        held: Held,
        leases: LeaseKeeper,
        stopping: asyncio.Event,
        clock: Clock,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.worker = worker
        self.load = load
        self.config = config  # None: no config deltas applied (the worker's own hash is advertised)
        self.held = held
        self.leases = leases
        self.stopping = stopping
        self.clock = clock

    async def progress_loop(self) -> None:
        """Progress-ACK held deliveries about every ``progress_interval_s`` while the worker is alive.

        When the worker stops answering Pings the leases lapse, so JetStream can hand the work to
        another pod after ack_wait.
        """
        interval = self.settings.progress_interval_s
        while not self.stopping.is_set():
            await self.clock.wait(self.stopping, interval / 2)
            if self.stopping.is_set() or not self.worker.fresh():
                continue
            now = self.clock.now()
            for lease in leases_of(self.held):
                if now - lease.last_progress >= interval:
                    await self.leases.progress(lease)

    def advertised_hash(self) -> str:
        """The last verified bundle_config_hash when config deltas are applied, else the worker's."""
        if self.config is not None:
            return self.config.advertised_hash()
        return self.worker.health.ping.bundle_config_hash or ""

    def heartbeat(self, *, terminated: bool = False) -> Heartbeat:
        s = self.settings
        ping = self.worker.health.ping
        return Heartbeat(
            name=s.worker_id,
            # a pod's model processes share its device: its first counts the GPU, the others none
            gpu_count=0 if s.process_index else 1,
            ready=False if terminated else self.worker.ready,
            terminated=terminated,
            machine_profile=s.machine_profile,
            pool_name=s.pool,
            bundle=s.bundle,
            bundle_config_hash=self.advertised_hash(),
            loaded_models=list(ping.loaded_models or []),
            model_states=dict(ping.model_states or {}),
            failed_models=dict(ping.failed_models or {}),
            weights=dict(ping.weights or {}),
            pinned_models=list(ping.pinned_models or []),
            queue_depth=self.load.queue_depth(),
            pending_cost=self.load.pending_cost(),
            inflight_batches=self.load.inflight_batches,
            saturated=self.load.saturated,
            unsupported_models=list(self.config.unsupported_models) if self.config is not None else [],
            timestamp=time.time(),
        )

    async def publish_heartbeat(self, *, terminated: bool = False) -> None:
        if self.stopping.is_set() and not terminated:
            # the tombstone is the last word: a Ping answered while stopping must not follow it
            # with a live heartbeat that makes the gateway route to this pod again
            return
        await self.nc.publish(
            health_subject(self.settings.worker_id), self.heartbeat(terminated=terminated).to_json()
        )

    async def announce(self) -> None:
        """A heartbeat now (readiness changed), besides the periodic ones."""
        try:
            await self.publish_heartbeat()
        except Exception as exc:  # noqa: BLE001 - heartbeats are best effort
            log.debug("heartbeat publish failed: %s", exc)

    async def heartbeat_loop(self) -> None:
        interval = self.settings.health_publish_interval_ms / 1000.0
        failures = 0
        while not self.stopping.is_set():
            try:
                await self.publish_heartbeat()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - heartbeats are best effort
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("heartbeat publish failed: %s", exc)
            await asyncio.sleep(interval)
