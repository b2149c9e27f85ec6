"""Lane choice and profile canonicalisation: pure functions of the request and the worker registry.

:class:`gateway.core.Gateway` calls these with its settings and registry; they touch no NATS, no
HTTP and no clock, so the unit tests in ``tests/unit/gateway/test_routing.py`` cover them directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.workers import WorkerRecord
from protocol.errors import invalid_input
from protocol.subjects import INTERACTIVE

ANY_PROFILE = ("", "any")


@dataclass(frozen=True)
class Lane:
    """Where work goes: one pool, machine profile and bundle (one JetStream durable per priority class,
    one scaling target), and the priority class of the request."""

    pool: str
    machine_profile: str
    bundle: str
    priority: str = INTERACTIVE


def split_routing_headers(profile: str | None, pool: str | None) -> tuple[str | None, str | None]:
    """``(pool, profile)`` from ``X-SIE-Pool`` and ``X-SIE-MACHINE-PROFILE``.

    A profile header of the form ``pool/profile`` names the pool too (``X-SIE-Pool`` wins).
    Empty values read as absent. Neither value is normalised here.
    """
    profile = profile or None
    pool = pool or None
    if profile and "/" in profile:
        head, _, tail = profile.partition("/")
        pool = pool or head or None
        profile = tail or None
    return pool, profile


def canonical_profile(value: str | None, configured: Sequence[str], live: Iterable[str]) -> str | None:
    """The machine profile a request asked for, as the cluster spells it.

    Lower-cased; ``l4`` reads as ``l4-spot`` when only the spot profile is configured; with no
    configured profiles anything goes; otherwise a profile neither configured nor live is an
    INVALID_INPUT error naming the configured ones.
    """
    if value is None or not value.strip():
        return None
    profile = value.strip().lower()
    if not configured:
        return profile
    if profile in configured:
        return profile
    if f"{profile}-spot" in configured:
        return f"{profile}-spot"
    if profile in set(live):
        return profile
    raise invalid_input(
        f"Machine profile '{value}' is not configured. Configured profiles: {list(configured)}",
        param="X-SIE-MACHINE-PROFILE",
        configured_gpu_types=list(configured),
    )


def lane_served(healthy: Iterable[WorkerRecord], lane: Lane) -> bool:
    """True when one of ``healthy`` is in ``lane``'s pool and serves its bundle and profile
    ("any"/"" = any profile)."""
    return any(
        w.pool == lane.pool
        and w.bundle == lane.bundle
        and (lane.machine_profile in ANY_PROFILE or w.profile == lane.machine_profile)
        for w in healthy
    )


def best_lane(
    model_id: str,
    bundles: Sequence[str],
    pool: str,
    candidates: Sequence[WorkerRecord],
    *,
    priority: str = INTERACTIVE,
) -> Lane:
    """The lane (profile, bundle) of ``candidates`` to publish to, in ``priority``'s class, best first by:

    a worker there has the model loaded; the bundle's rank in ``bundles``; the lane's mean queue
    depth; then profile and bundle names, so that equal lanes always pick the same one.
    ``candidates`` must not be empty.
    """
    if not candidates:
        raise ValueError("best_lane needs at least one candidate worker")
    order = {b.lower(): i for i, b in enumerate(bundles)}
    lanes: dict[tuple[str, str], list[WorkerRecord]] = {}
    for w in candidates:
        lanes.setdefault((w.profile, w.bundle), []).append(w)

    def score(item: tuple[tuple[str, str], list[WorkerRecord]]) -> tuple[bool, int, float, str, str]:
        (profile, bundle), ws = item
        loaded = any(w.has_loaded(model_id) for w in ws)
        depth = sum(w.heartbeat.queue_depth for w in ws) / len(ws)
        return (not loaded, order.get(bundle, 99), depth, profile, bundle)

    (profile, bundle), _ = min(lanes.items(), key=score)
    return Lane(pool, profile, bundle, priority)


def lane_pullers(workers: Iterable[WorkerRecord], lane: Lane) -> list[WorkerRecord]:
    """Those of ``workers`` that pull from ``lane``'s durables. JetStream hands the lane's messages
    round their pull requests one by one, so a request's items reach one pod whole only when it is
    the only one."""
    key = (lane.pool, lane.machine_profile, lane.bundle)
    return [w for w in workers if (w.pool, w.profile, w.bundle) == key]


def provisioning_message(model_id: str, profile: str | None, pool_name: str | None) -> str:
    """The message of a PROVISIONING answer: what is missing, and where."""
    where = f"pool '{pool_name}'" if pool_name else "the cluster"
    what = f"machine profile '{profile}'" if profile else "any machine profile"
    return f"No ready worker for model '{model_id}' on {what} in {where}; capacity is being provisioned"
