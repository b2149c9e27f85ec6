"""``GET /v1/configs/models/{id}/status``: has a config change reached the workers?

The gateway answers it because both halves are already here: the expected bundle_config_hash per
bundle and pool (from the config service's export and deltas, the same numbers the sidecars verify
against) and every worker's heartbeat (its advertised hash, loaded/loading models and the last load
error per model). The config service neither reads heartbeats nor keeps worker state.
"""

from __future__ import annotations

from typing import TypedDict

from aiohttp import web

from gateway.parts import REGISTRY_KEY, WORKERS_KEY
from gateway.registry import ModelRegistry
from gateway.workers import WorkerRecord, WorkerRegistry
from iokit import http


def _in_state(w: WorkerRecord, model_id: str, state: str) -> bool:
    return any(
        s == state and (spec == model_id or spec.startswith(model_id + ":"))
        for spec, s in w.profile_states().items()
    )


class PoolRollout(TypedDict):
    pool: str
    bundle_id: str
    expected_bundle_config_hash: str
    workers: int
    acked_workers: int
    pending_workers: int
    loaded_workers: int
    loading_workers: int
    failed_workers: int
    last_error: str | None


class BundleRollout(TypedDict):
    bundle_id: str
    expected_bundle_config_hash: str
    total_eligible_workers: int
    acked_workers: int
    pending_workers: int
    acked: bool


class ModelRollout(TypedDict):
    """The answer of ``GET /v1/configs/models/{id}/status``."""

    model_id: str
    config_epoch: int
    all_bundles_acked: bool
    no_bundles: bool
    bundles: list[BundleRollout]
    pools: list[PoolRollout]
    loaded: bool
    last_error: str | None
    source: str


def model_rollout(registry: ModelRegistry, fleet: WorkerRegistry, model_id: str) -> ModelRollout | None:
    """Per bundle and per (bundle, pool): healthy workers, how many advertise the expected hash,
    how many have the model loaded, loading or failed, and the last load error. None: unknown model."""
    config = registry.model_config(model_id)
    if config is None:
        return None
    bundles = registry.model_bundles(config)
    by_lower = {b.lower(): b for b in bundles}  # heartbeats name bundles lower-cased
    groups: dict[tuple[str, str], list[WorkerRecord]] = {}
    for w in fleet.healthy():
        if w.bundle in by_lower:
            groups.setdefault((by_lower[w.bundle], w.pool), []).append(w)
    pools: list[PoolRollout] = []
    for (bundle, pool), workers in sorted(groups.items()):
        expected = registry.expected_hash(bundle, pool)
        acked = [w for w in workers if w.heartbeat.bundle_config_hash == expected]
        errors = [f"{spec}: {msg}" for w in workers for spec, msg in sorted(w.load_errors(model_id).items())]
        failed = [w for w in workers if w.load_errors(model_id)]
        pools.append(
            {
                "pool": pool,
                "bundle_id": bundle,
                "expected_bundle_config_hash": expected,
                "workers": len(workers),
                "acked_workers": len(acked),
                "pending_workers": len(workers) - len(acked),
                "loaded_workers": sum(1 for w in workers if w.has_loaded(model_id)),
                "loading_workers": sum(1 for w in workers if _in_state(w, model_id, "loading")),
                "failed_workers": len(failed),
                "last_error": errors[-1] if errors else None,
            }
        )
    per_bundle: list[BundleRollout] = []
    for bundle in bundles:
        mine = [p for p in pools if p["bundle_id"] == bundle]
        total = sum(p["workers"] for p in mine)
        n_acked = sum(p["acked_workers"] for p in mine)
        per_bundle.append(
            {
                "bundle_id": bundle,
                "expected_bundle_config_hash": registry.bundle_hash(bundle),
                "total_eligible_workers": total,
                "acked_workers": n_acked,
                "pending_workers": total - n_acked,
                "acked": n_acked == total,
            }
        )
    last_errors = [p["last_error"] for p in pools if p["last_error"]]
    return {
        "model_id": model_id,
        "config_epoch": registry.config_epoch()["epoch"],
        "all_bundles_acked": all(b["acked"] for b in per_bundle),
        "no_bundles": not bundles,
        "bundles": per_bundle,
        "pools": pools,
        "loaded": any(p["loaded_workers"] for p in pools),
        "last_error": last_errors[-1] if last_errors else None,
        "source": "gateway",
    }


async def handle_config_model_status(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    body = model_rollout(request.app[REGISTRY_KEY], request.app[WORKERS_KEY], model_id)
    if body is None:
        return http.config_error_response(
            404, "model_not_found", f"model {model_id!r} is not configured", model_id=model_id
        )
    return web.json_response(body)
