"""Resource pools: leases with a TTL, kept in a JetStream key-value bucket.

Several gateway replicas share the bucket, so every read goes to the bucket (no local copy to go
stale). A pool's assignment and state are derived from the live worker registry at read time.
"""

from __future__ import annotations

import builtins  # PoolStore.list shadows list inside the class
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from gateway.kv import bucket_keys
from gateway.pool_spec import DEFAULT_POOL, PoolRecord, PoolSpec, SpecRules, normalize_pool_name
from gateway.workers import WorkerRecord, WorkerRegistry
from protocol.errors import ErrorCode, SIEError, invalid_input

log = logging.getLogger(__name__)

PoolView = dict[str, object]  # a pool as the API shows it


class PoolStore:
    def __init__(
        self,
        kv: KeyValue,
        workers: WorkerRegistry,
        *,
        default_ttl_s: float = 1200.0,
        max_ttl_s: float = 3600.0,
        max_pools: int = 64,
        known_profiles: Callable[[], list[str]] = list,
        known_bundles: Callable[[], list[str]] = list,
        check_model: Callable[[str], None] = lambda m: None,
        clock: Callable[[], float] = time.time,
        on_event: Callable[[str], None] = lambda e: None,
    ) -> None:
        self.kv = kv
        self.workers = workers
        self.default_ttl_s = default_ttl_s
        self.max_pools = max_pools
        self.known_profiles = known_profiles
        self.rules = SpecRules(
            default_ttl_s=default_ttl_s,
            max_ttl_s=max_ttl_s,
            known_profiles=known_profiles,
            known_bundles=known_bundles,
            check_model=check_model,
        )
        self.clock = clock
        self.on_event = on_event

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str,
        workers: WorkerRegistry,
        *,
        storage: str = "file",
        replicas: int = 1,
        **kwargs: Any,
    ) -> PoolStore:
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            st = StorageType.FILE if storage == "file" else StorageType.MEMORY
            try:
                kv = await js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=1, storage=st, replicas=replicas)
                )
            except nats.js.errors.BadRequestError:
                kv = await js.key_value(bucket)
        return cls(kv, workers, **kwargs)

    # ---- records ---------------------------------------------------------------------------
    async def _load(self, name: str) -> PoolRecord | None:
        try:
            entry = await self.kv.get(name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if entry.value is None:
            return None
        try:
            data = json.loads(entry.value)
        except ValueError:
            return None
        record = PoolRecord.from_json(data)
        if self._expired(record):
            await self._delete(name)
            self.on_event("expired")
            return None
        return record

    def _expired(self, record: PoolRecord) -> bool:
        ttl = record.ttl_seconds or self.default_ttl_s
        return self.clock() - record.last_renewed > ttl

    async def _delete(self, name: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self.kv.delete(name)

    async def _names(self) -> list[str]:
        return await bucket_keys(self.kv)

    # ---- API -------------------------------------------------------------------------------
    async def create(self, body: Any) -> PoolView:
        spec = self.rules.spec(body)
        name = spec.name
        now = self.clock()
        existing = await self._load(name)
        if existing is None and len(await self._names()) >= self.max_pools:
            raise invalid_input(f"At most {self.max_pools} pools may exist")
        record = PoolRecord(spec, spec.ttl_seconds, existing.created_at if existing else now, now)
        await self.kv.put(name, record.to_bytes())
        self.on_event("renewed" if existing else "created")
        return self.view(name, record)

    async def get(self, name: str) -> PoolView | None:
        name = normalize_pool_name(name)
        if name == DEFAULT_POOL:
            return self.default_view()
        record = await self._load(name)
        return None if record is None else self.view(name, record)

    async def renew(self, name: str) -> bool:
        name = normalize_pool_name(name)
        if name == DEFAULT_POOL:
            return True
        record = await self._load(name)
        if record is None:
            return False
        record.last_renewed = self.clock()
        await self.kv.put(name, record.to_bytes())
        self.on_event("renewed")
        return True

    async def delete(self, name: str) -> bool:
        name = normalize_pool_name(name)
        if name == DEFAULT_POOL:
            raise SIEError(ErrorCode.FORBIDDEN, "The 'default' pool cannot be deleted")
        record = await self._load(name)
        if record is None:
            return False
        await self._delete(name)
        self.on_event("deleted")
        return True

    async def list(self) -> list[PoolView]:
        out = [self.default_view()]
        for name in sorted(await self._names()):
            record = await self._load(name)
            if record is not None:
                out.append(self.view(name, record))
        return out

    async def pins(self) -> dict[str, builtins.list[str]]:
        """Worker id → the pinned models of every pool it is assigned to (sorted, no repeats):
        what :meth:`gateway.core.Gateway.publish_pins` sends each worker's sidecar."""
        out: dict[str, set[str]] = {}
        for name in await self._names():
            record = await self._load(name)
            if record is None:
                continue
            spec = record.spec
            models = spec.pinned_models
            if not models:
                continue
            for worker in self.assigned(spec):
                out.setdefault(worker.worker_id, set()).update(models)
        return {wid: sorted(models) for wid, models in out.items()}

    async def sweep(self) -> int:
        """Delete expired pools; returns how many."""
        removed = 0
        for name in await self._names():
            try:
                entry = await self.kv.get(name)
                record = PoolRecord.from_json(json.loads(entry.value or b""))
            except Exception:
                continue
            if self._expired(record):
                await self._delete(name)
                self.on_event("expired")
                removed += 1
        return removed

    # ---- assignment ------------------------------------------------------------------------
    def assigned(self, spec: PoolSpec) -> builtins.list[WorkerRecord]:
        queue_pool = spec.queue_pool or DEFAULT_POOL
        bundle = spec.bundle
        gpus = spec.gpus
        caps = spec.gpu_caps
        taken: dict[str, int] = {}
        out = []
        for w in sorted(self.workers.healthy(), key=lambda w: w.worker_id):
            if w.pool != queue_pool or (bundle and w.bundle != bundle):
                continue
            if gpus and w.profile not in gpus and w.profile not in caps:
                continue
            cap = caps.get(w.profile)
            if cap is None and w.profile in gpus:
                cap = max(gpus[w.profile], 1)
            if cap is not None and taken.get(w.profile, 0) >= cap:
                continue
            taken[w.profile] = taken.get(w.profile, 0) + 1
            out.append(w)
        return out

    def state(self, spec: PoolSpec, assigned: builtins.list[WorkerRecord]) -> str:
        if not assigned or len(assigned) < spec.minimum_worker_count:
            return "pending"
        for prof, count in spec.gpus.items():
            if sum(1 for w in assigned if w.profile == prof) < count:
                return "pending"
        return "active"

    def view(self, name: str, record: PoolRecord) -> PoolView:
        spec = record.spec
        assigned = self.assigned(spec)
        return {
            "name": name,
            "spec": {k: v for k, v in spec.to_json().items() if k != "ttl_seconds"}
            | {"ttl_seconds": record.ttl_seconds},
            "status": {
                "state": self.state(spec, assigned),
                "assigned_workers": [
                    {"name": w.heartbeat.name or w.worker_id, "url": "", "gpu": w.profile, "bundle": w.bundle}
                    for w in assigned
                ],
                "created_at": record.created_at,
                "last_renewed": record.last_renewed,
            },
        }

    def default_view(self) -> PoolView:
        workers = [w for w in self.workers.healthy() if w.pool == DEFAULT_POOL]
        profiles = sorted({p.lower() for p in self.known_profiles()})
        return {
            "name": DEFAULT_POOL,
            "spec": {
                "name": DEFAULT_POOL,
                "queue_pool": DEFAULT_POOL,
                "gpus": {p: 999 for p in profiles},
                "gpu_caps": {},
                "bundle": None,
                "minimum_worker_count": 0,
                "pinned_models": [],
                "ttl_seconds": None,
            },
            "status": {
                "state": "active" if workers else "pending",
                "assigned_workers": [
                    {"name": w.heartbeat.name or w.worker_id, "url": "", "gpu": w.profile, "bundle": w.bundle}
                    for w in workers
                ],
                "created_at": 0.0,
                "last_renewed": self.clock(),
            },
        }

    async def lookup(self, name: str) -> PoolSpec | None:
        """The spec and assignment of a pool for routing, or None if it does not exist."""
        name = normalize_pool_name(name)
        if name == DEFAULT_POOL:
            return None
        record = await self._load(name)
        if record is None:
            return None
        return record.spec
