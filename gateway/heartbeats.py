"""The sidecars' heartbeats (``sie.health.<worker_id>``) into the worker registry, and asking for
them at once (``sie.health_solicit``) when a gateway starts or reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gateway.workers import WorkerRegistry
from protocol.subjects import HEALTH_PREFIX, HEALTH_SOLICIT

log = logging.getLogger(__name__)


class HeartbeatListener:
    def __init__(self, nc: NATS, workers: WorkerRegistry) -> None:
        self.nc = nc
        self.workers = workers
        self._heard = asyncio.Event()  # a heartbeat came since the last solicit
        self._sub: Subscription | None = None
        self.listening_since: float | None = None  # time.monotonic() of the subscription

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(HEALTH_PREFIX + ".>", cb=self._on_heartbeat)
        self.listening_since = time.monotonic()
        await self.solicit()

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def solicit(self) -> None:
        """Ask every sidecar for its heartbeat now. Until it hears one, a gateway knows no live
        worker and answers PROVISIONING (Retry-After 10 s) for lanes that are served: up to a
        heartbeat interval after it starts, and after a reconnect once its workers went stale."""
        self._heard.clear()
        try:
            await self.nc.publish(HEALTH_SOLICIT, b"")
        except Exception as exc:  # noqa: BLE001 - the periodic heartbeats come anyway
            log.warning("asking the workers for their heartbeats failed: %s", exc)

    async def hear_workers(self, wait_s: float, settle_s: float = 0.2) -> int:
        """Wait (at most ``wait_s``) for the first heartbeat after :meth:`solicit`, and ``settle_s``
        more for the others; how many workers are healthy then. What ``serve`` does before it
        listens: replicas sharing a port get connections as soon as they listen."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), wait_s)
            await asyncio.sleep(settle_s)
        return len(self.workers.healthy())

    async def _on_heartbeat(self, msg: Msg) -> None:
        worker_id = msg.subject[len(HEALTH_PREFIX) + 1 :]
        self.workers.observe(worker_id, msg.data)
        self._heard.set()
