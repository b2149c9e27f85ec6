"""Resource pools: leases with a TTL, kept in a JetStream key-value bucket.

Several gateway replicas share the bucket, so every read goes to the bucket (no local copy to go
stale). A pool's assignment and state are derived from the live worker registry at read time.
"""

from __future__ import annotations

import builtins  # PoolStore.list shadows list inside the class
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue
from pydantic import ValidationError

from gateway.kv import bucket_keys
from gateway.workers import WorkerRecord, WorkerRegistry
from protocol.api import PoolBody
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.subjects import PRIORITIES

log = logging.getLogger(__name__)

DEFAULT_POOL = "default"
POOL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
MAX_MINIMUM_WORKERS = 64


def normalize_pool_name(name: Any) -> str:
    if not isinstance(name, str) or not POOL_NAME_RE.match(name.strip().lower()):
        raise invalid_input(
            "Pool name must be 1-63 characters of letters, digits, '-' or '_' (starting with a letter or digit)",
            param="name",
        )
    return name.strip().lower()


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
        self.max_ttl_s = max_ttl_s
        self.max_pools = max_pools
        self.known_profiles = known_profiles
        self.known_bundles = known_bundles
        self.check_model = check_model
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
    async def _load(self, name: str) -> dict[str, Any] | None:
        try:
            entry = await self.kv.get(name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if entry.value is None:
            return None
        try:
            record: dict[str, Any] = json.loads(entry.value)
        except ValueError:
            return None
        if self._expired(record):
            await self._delete(name)
            self.on_event("expired")
            return None
        return record

    def _expired(self, record: dict[str, Any]) -> bool:
        ttl = float(record.get("ttl_seconds") or self.default_ttl_s)
        return self.clock() - float(record.get("last_renewed", 0)) > ttl

    async def _delete(self, name: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self.kv.delete(name)

    async def _names(self) -> list[str]:
        return await bucket_keys(self.kv)

    # ---- validation ------------------------------------------------------------------------
    def _validate_spec(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise invalid_input("Pool body must be a JSON object")
        try:
            PoolBody.model_validate(body)  # the types (what /openapi.json shows); names below
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise invalid_input(f"Field '{loc}': {err['msg']}", param=str(err["loc"][0])) from None
        name = normalize_pool_name(body.get("name"))
        if name == DEFAULT_POOL:
            raise SIEError(ErrorCode.FORBIDDEN, "The 'default' pool is built in and cannot be changed")
        profiles = {p.lower() for p in self.known_profiles()}

        def profile_map(key: str) -> dict[str, int]:
            raw = body.get(key) or {}
            if not isinstance(raw, dict):
                raise invalid_input(f"'{key}' must be a map of machine profile to count", param=key)
            out: dict[str, int] = {}
            for prof, count in raw.items():
                p = str(prof).strip().lower()
                if p not in profiles:
                    raise invalid_input(
                        f"Unknown machine profile '{prof}'. Valid profiles: {sorted(profiles)}", param=key
                    )
                if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                    raise invalid_input(f"'{key}.{prof}' must be a non-negative integer", param=key)
                out[p] = count
            return out

        gpus = profile_map("gpus")
        caps = profile_map("gpu_caps")
        bundle = body.get("bundle")
        if bundle is not None:
            if not isinstance(bundle, str) or bundle.lower() not in {b.lower() for b in self.known_bundles()}:
                raise invalid_input(
                    f"Unknown bundle '{bundle}'. Valid bundles: {self.known_bundles()}", param="bundle"
                )
            bundle = bundle.lower()
        queue_pool = body.get("queue_pool") or DEFAULT_POOL
        queue_pool = normalize_pool_name(queue_pool)
        mwc = body.get("minimum_worker_count", 0)
        if not isinstance(mwc, int) or isinstance(mwc, bool) or not 0 <= mwc <= MAX_MINIMUM_WORKERS:
            raise invalid_input(
                f"'minimum_worker_count' must be an integer in 0..{MAX_MINIMUM_WORKERS}",
                param="minimum_worker_count",
            )
        pinned = body.get("pinned_models") or []
        if not isinstance(pinned, list) or not all(isinstance(m, str) for m in pinned):
            raise invalid_input("'pinned_models' must be a list of model ids", param="pinned_models")
        for model in pinned:
            try:
                self.check_model(model)
            except SIEError as exc:
                raise invalid_input(f"Unknown pinned model '{model}'", param="pinned_models") from exc
        priority = body.get("priority")
        if priority is not None and priority not in PRIORITIES:
            raise invalid_input(f"'priority' must be one of {list(PRIORITIES)}", param="priority")
        ttl = body.get("ttl_seconds", self.default_ttl_s)
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= self.max_ttl_s:
            raise invalid_input(f"'ttl_seconds' must be in (0, {self.max_ttl_s}]", param="ttl_seconds")
        spec: dict[str, Any] = {
            "name": name,
            "queue_pool": queue_pool,
            "gpus": gpus,
            "gpu_caps": caps,
            "bundle": bundle,
            "minimum_worker_count": mwc,
            "pinned_models": pinned,
            "ttl_seconds": float(ttl),
        }
        if priority is not None:
            spec["priority"] = priority  # the default priority class of the pool's requests
        return spec

    # ---- API -------------------------------------------------------------------------------
    async def create(self, body: Any) -> dict[str, Any]:
        spec = self._validate_spec(body)
        name = spec["name"]
        now = self.clock()
        existing = await self._load(name)
        if existing is None and len(await self._names()) >= self.max_pools:
            raise invalid_input(f"At most {self.max_pools} pools may exist")
        record = {
            "spec": spec,
            "ttl_seconds": spec["ttl_seconds"],
            "created_at": existing["created_at"] if existing else now,
            "last_renewed": now,
        }
        await self.kv.put(name, json.dumps(record).encode())
        self.on_event("renewed" if existing else "created")
        return self.view(name, record)

    async def get(self, name: str) -> dict[str, Any] | None:
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
        record["last_renewed"] = self.clock()
        await self.kv.put(name, json.dumps(record).encode())
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

    async def list(self) -> list[dict[str, Any]]:
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
            spec = record["spec"]
            models = spec.get("pinned_models") or []
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
                record = json.loads(entry.value or b"")
            except Exception:
                continue
            if self._expired(record):
                await self._delete(name)
                self.on_event("expired")
                removed += 1
        return removed

    # ---- assignment ------------------------------------------------------------------------
    def assigned(self, spec: dict[str, Any]) -> builtins.list[WorkerRecord]:
        queue_pool = spec.get("queue_pool") or DEFAULT_POOL
        bundle = spec.get("bundle")
        gpus: dict[str, int] = spec.get("gpus") or {}
        caps: dict[str, int] = spec.get("gpu_caps") or {}
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

    def state(self, spec: dict[str, Any], assigned: builtins.list[WorkerRecord]) -> str:
        if not assigned or len(assigned) < spec.get("minimum_worker_count", 0):
            return "pending"
        for prof, count in (spec.get("gpus") or {}).items():
            if sum(1 for w in assigned if w.profile == prof) < count:
                return "pending"
        return "active"

    def view(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        spec = record["spec"]
        assigned = self.assigned(spec)
        return {
            "name": name,
            "spec": {k: v for k, v in spec.items() if k != "ttl_seconds"}
            | {"ttl_seconds": record["ttl_seconds"]},
            "status": {
                "state": self.state(spec, assigned),
                "assigned_workers": [
                    {"name": w.heartbeat.name or w.worker_id, "url": "", "gpu": w.profile, "bundle": w.bundle}
                    for w in assigned
                ],
                "created_at": record["created_at"],
                "last_renewed": record["last_renewed"],
            },
        }

    def default_view(self) -> dict[str, Any]:
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

    async def lookup(self, name: str) -> dict[str, Any] | None:
        """The spec and assignment of a pool for routing, or None if it does not exist."""
        name = normalize_pool_name(name)
        if name == DEFAULT_POOL:
            return None
        record = await self._load(name)
        if record is None:
            return None
        spec: dict[str, Any] = record["spec"]
        return spec
