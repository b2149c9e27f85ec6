"""Worker registry built from sidecar heartbeats on ``sie.health.<worker_id>``.

A worker is healthy while its last heartbeat said ``ready`` and is younger than ``stale_after_s``;
a heartbeat with ``terminated: true`` (shutdown tombstone) removes it at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.work import Heartbeat

log = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    worker_id: str
    heartbeat: Heartbeat
    last_seen: float

    @property
    def pool(self) -> str:
        return (self.heartbeat.pool_name or "default").lower()

    @property
    def profile(self) -> str:
        return (self.heartbeat.machine_profile or "default").lower()

    @property
    def bundle(self) -> str:
        return (self.heartbeat.bundle or "default").lower()

    def has_loaded(self, model_id: str) -> bool:
        return model_id in self.heartbeat.loaded_models

    def profile_states(self) -> dict[str, str]:
        """Routable name → loaded | loading | failed, as the worker reported it (empty from an older sidecar)."""
        states = self.heartbeat.model_states
        return states if isinstance(states, dict) else {}

    def load_errors(self, model_id: str) -> dict[str, str]:
        """The model's profiles whose last load failed here → the error message."""
        failed = self.heartbeat.failed_models
        if not isinstance(failed, dict):
            return {}
        return {
            str(spec): str(msg)
            for spec, msg in failed.items()
            if str(spec) == model_id or str(spec).startswith(model_id + ":")
        }

    def supports(self, model_id: str) -> bool:
        return model_id not in (self.heartbeat.unsupported_models or [])


class WorkerRegistry:
    def __init__(self, stale_after_s: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        # changes with every heartbeat applied and every worker removed: what was decided from the
        # registry holds while it stays the same (and no worker it looked at turns stale)
        self.generation = 0

    def observe(self, worker_id: str, data: bytes) -> WorkerRecord | None:
        """Apply one heartbeat message; returns the worker's state (None when removed or invalid)."""
        try:
            hb = Heartbeat.parse(data)
        except Exception as exc:  # a malformed heartbeat must not disturb the registry
            log.warning("ignoring malformed heartbeat from %s: %s", worker_id, exc)
            return None
        key = worker_id or hb.name
        self.generation += 1
        if hb.terminated:
            self._workers.pop(key, None)
            return None
        state = WorkerRecord(key, hb, self._clock())
        self._workers[key] = state
        return state

    def remove(self, worker_id: str) -> None:
        self.generation += 1
        self._workers.pop(worker_id, None)

    def now(self) -> float:
        return self._clock()

    def healthy_until(self, workers: list[WorkerRecord]) -> float:
        """When the first of ``workers`` turns stale, unless a heartbeat comes first."""
        return min(w.last_seen for w in workers) + self.stale_after_s

    def is_healthy(self, w: WorkerRecord) -> bool:
        return w.heartbeat.ready and (self._clock() - w.last_seen) <= self.stale_after_s

    def all(self) -> list[WorkerRecord]:
        return list(self._workers.values())

    def healthy(self) -> list[WorkerRecord]:
        return [w for w in self._workers.values() if self.is_healthy(w)]

    def prune(self, forget_after_s: float | None = None) -> None:
        """Forget workers silent for much longer than the staleness bound."""
        limit = forget_after_s if forget_after_s is not None else self.stale_after_s * 20
        now = self._clock()
        for key, w in list(self._workers.items()):
            if now - w.last_seen > limit:
                del self._workers[key]
                self.generation += 1

    def select(
        self,
        *,
        pool: str | None,
        profile: str | None,
        bundles: list[str],
        model_id: str,
    ) -> list[WorkerRecord]:
        """Healthy workers able to serve ``model_id`` in one of ``bundles`` (optionally pool/profile)."""
        wanted = {b.lower() for b in bundles}
        out = []
        for w in self.healthy():
            if pool is not None and w.pool != pool:
                continue
            if profile is not None and w.profile != profile:
                continue
            if w.bundle not in wanted or not w.supports(model_id):
                continue
            out.append(w)
        return out

    def live_profiles(self) -> list[str]:
        return sorted({w.profile for w in self.healthy()})
