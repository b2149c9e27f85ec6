"""What the sidecar says while alive: progress-ACKs that keep held leases, heartbeats to the gateways."""

from __future__ import annotations

import asyncio
import logging
import time

from protocol.subjects import health_subject
from protocol.work import Heartbeat
from sidecar.readiness import Readiness

log = logging.getLogger("sie.sidecar")


class Liveness(Readiness):
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
            model_states=dict(self.worker.ping.model_states or {}),
            failed_models=dict(self.worker.ping.failed_models or {}),
            weights=dict(self.worker.ping.weights or {}),
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
