"""A resource pool's spec and stored record, and the checks a ``POST /v1/pools`` body passes to
become a spec (its types, then its names against the cluster: profiles, bundles, models)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from protocol.api import PoolBody
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.subjects import PRIORITIES

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


@dataclass(frozen=True)
class PoolSpec:
    name: str
    queue_pool: str = DEFAULT_POOL
    gpus: dict[str, int] = field(default_factory=dict)  # machine profile → workers wanted
    gpu_caps: dict[str, int] = field(default_factory=dict)  # machine profile → most workers taken
    bundle: str | None = None
    minimum_worker_count: int = 0
    pinned_models: list[str] = field(default_factory=list)
    ttl_seconds: float | None = None
    priority: str | None = None  # the default priority class of the pool's requests

    def to_json(self) -> dict[str, object]:
        """Its stored form (also what a pool's view shows; ``priority`` only when set)."""
        out: dict[str, object] = {
            "name": self.name,
            "queue_pool": self.queue_pool,
            "gpus": self.gpus,
            "gpu_caps": self.gpu_caps,
            "bundle": self.bundle,
            "minimum_worker_count": self.minimum_worker_count,
            "pinned_models": self.pinned_models,
            "ttl_seconds": self.ttl_seconds,
        }
        if self.priority is not None:
            out["priority"] = self.priority
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PoolSpec:
        ttl = data.get("ttl_seconds")
        return cls(
            name=str(data.get("name", "")),
            queue_pool=data.get("queue_pool") or DEFAULT_POOL,
            gpus=dict(data.get("gpus") or {}),
            gpu_caps=dict(data.get("gpu_caps") or {}),
            bundle=data.get("bundle"),
            minimum_worker_count=int(data.get("minimum_worker_count", 0)),
            pinned_models=list(data.get("pinned_models") or []),
            ttl_seconds=float(ttl) if ttl is not None else None,
            priority=data.get("priority"),
        )


@dataclass
class PoolRecord:
    """What the bucket keeps of a pool: its spec and lease (unix seconds)."""

    spec: PoolSpec
    ttl_seconds: float | None
    created_at: float
    last_renewed: float

    def to_bytes(self) -> bytes:
        record = {
            "spec": self.spec.to_json(),
            "ttl_seconds": self.ttl_seconds,
            "created_at": self.created_at,
            "last_renewed": self.last_renewed,
        }
        return json.dumps(record).encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PoolRecord:
        ttl = data.get("ttl_seconds")
        return cls(
            PoolSpec.from_json(data.get("spec") or {}),
            float(ttl) if ttl is not None else None,
            float(data.get("created_at", 0.0)),
            float(data.get("last_renewed", 0)),
        )


class SpecRules:
    """What a pool body must be to become a spec, against this cluster's profiles, bundles and models."""

    def __init__(
        self,
        *,
        default_ttl_s: float,
        max_ttl_s: float,
        known_profiles: Callable[[], list[str]],
        known_bundles: Callable[[], list[str]],
        check_model: Callable[[str], None],
    ) -> None:
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.known_profiles = known_profiles
        self.known_bundles = known_bundles
        self.check_model = check_model

    def spec(self, body: Any) -> PoolSpec:
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
        gpus = _profile_map(body, "gpus", profiles)
        caps = _profile_map(body, "gpu_caps", profiles)
        bundle = body.get("bundle")
        if bundle is not None:
            if not isinstance(bundle, str) or bundle.lower() not in {b.lower() for b in self.known_bundles()}:
                raise invalid_input(
                    f"Unknown bundle '{bundle}'. Valid bundles: {self.known_bundles()}", param="bundle"
                )
            bundle = bundle.lower()
        queue_pool = normalize_pool_name(body.get("queue_pool") or DEFAULT_POOL)
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
        return PoolSpec(name, queue_pool, gpus, caps, bundle, mwc, pinned, float(ttl), priority)


def _profile_map(body: dict[str, Any], key: str, profiles: set[str]) -> dict[str, int]:
    """``body[key]``, a map of machine profile (one of ``profiles``) to a count."""
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
