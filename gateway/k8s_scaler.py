"""Scale worker StatefulSets from zero through the Kubernetes API (clusters without KEDA).

The Helm chart renders, when KEDA is not installed::

    SIE_GATEWAY_K8S_SCALER_ENABLED=true
    SIE_GATEWAY_K8S_NAMESPACE=<pod namespace>
    SIE_GATEWAY_K8S_SCALER_TARGETS=pool:profile:bundle=statefulset,...
    SIE_GATEWAY_K8S_SCALER_INTERVAL_S=5

and a Role that allows get/patch on ``statefulsets/scale`` of exactly those StatefulSets.

Only the 0 → 1 step lives here: when the gateway has pending demand for a lane
``(pool, machine_profile, bundle)`` and no live worker of that pool serves it, the lane's
StatefulSet is patched to 1 (``min_replicas``) if its scale is 0; other pools' StatefulSets of
the same profile and bundle stay asleep. Scaling further out and back in is KEDA's job
(or an operator's); this never scales down, so it cannot fight a human or an HPA.

The client is anything with the two ``kubernetes.client.AppsV1Api`` methods used here
(``read_namespaced_stateful_set_scale`` and ``patch_namespaced_stateful_set_scale``); the
kubernetes client is synchronous, so calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.routing import ANY_PROFILE, Lane

log = logging.getLogger("gateway.k8s_scaler")


def parse_targets(spec: str | Iterable[str]) -> dict[Lane, str]:
    """``pool:profile:bundle=statefulset`` entries (comma-separated) → {Lane: statefulset}."""
    items = [s for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out: dict[Lane, str] = {}
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        lane_part, sep, name = item.partition("=")
        parts = lane_part.split(":")
        if not sep or len(parts) != 3 or not all(p.strip() for p in parts) or not name.strip():
            raise ValueError(f"scaler target {item!r} is not pool:profile:bundle=statefulset")
        pool, profile, bundle = (p.strip().lower() for p in parts)
        out[Lane(pool, profile, bundle)] = name.strip()
    return out


class K8sScalerSettings(BaseSettings):
    """The gateway's settings for this option (env prefix ``SIE_GATEWAY_K8S_``)."""

    model_config = SettingsConfigDict(env_prefix="SIE_GATEWAY_K8S_", extra="ignore")

    scaler_enabled: bool = False
    namespace: str = "default"
    scaler_targets: str = ""
    scaler_interval_s: float = Field(default=5.0, gt=0)
    # One read per StatefulSet at most this often while its demand stays pending.
    scaler_recheck_s: float = Field(default=15.0, ge=0)
    scaler_min_replicas: int = Field(default=1, ge=1)

    @field_validator("scaler_targets")
    @classmethod
    def _targets(cls, value: str) -> str:
        parse_targets(value)
        return value

    def targets(self) -> dict[Lane, str]:
        return parse_targets(self.scaler_targets)


@dataclass
class ScaleEvent:
    statefulset: str
    lane: Lane
    from_replicas: int
    to_replicas: int


@dataclass
class K8sScaler:
    """Wake worker StatefulSets from zero for lanes with pending demand and no workers."""

    api: Any  # kubernetes.client.AppsV1Api or anything with the same two methods
    namespace: str
    targets: Mapping[Lane, str]
    min_replicas: int = 1
    recheck_s: float = 15.0
    clock: Callable[[], float] = time.monotonic
    events: list[ScaleEvent] = field(default_factory=list)
    _last_check: dict[str, float] = field(default_factory=dict)

    def statefulsets_for(
        self, machine_profile: str, bundle: str, pool: str | None = None
    ) -> list[tuple[Lane, str]]:
        """The targets of ``(machine_profile, bundle)`` (in ``pool``, else in any pool). Demand that
        named no profile ("any") wakes the first target of the bundle, in the order the targets are
        configured (the chart's order of profiles): one lane to serve it, not every profile's."""
        profile, bundle = machine_profile.lower(), bundle.lower()
        found = [
            (lane, name)
            for lane, name in self.targets.items()
            if lane.bundle == bundle
            and (pool is None or lane.pool == pool.lower())
            and (profile in ANY_PROFILE or lane.machine_profile == profile)
        ]
        return found[:1] if profile in ANY_PROFILE else found

    def wake(self, machine_profile: str, bundle: str, pool: str | None = None) -> list[ScaleEvent]:
        """Scale each matching StatefulSet that is at 0 replicas to ``min_replicas`` (blocking).

        A StatefulSet checked less than ``recheck_s`` ago is skipped, so a burst of requests costs
        one API read. API errors are logged and leave the next check to the next call.
        """
        done: list[ScaleEvent] = []
        now = self.clock()
        for lane, name in self.statefulsets_for(machine_profile, bundle, pool):
            last = self._last_check.get(name)
            if last is not None and now - last < self.recheck_s:
                continue
            self._last_check[name] = now
            try:
                scale = self.api.read_namespaced_stateful_set_scale(name, self.namespace)
                current = int(scale.spec.replicas or 0)
                if current > 0:
                    continue
                self.api.patch_namespaced_stateful_set_scale(
                    name, self.namespace, {"spec": {"replicas": self.min_replicas}}
                )
            except Exception as exc:  # noqa: BLE001 - ApiException, connection errors: retry later
                log.warning("scale-from-zero of %s/%s failed: %s", self.namespace, name, exc)
                self._last_check.pop(name, None)
                continue
            event = ScaleEvent(name, lane, current, self.min_replicas)
            log.info("scaled %s/%s from 0 to %d for pending demand", self.namespace, name, self.min_replicas)
            self.events.append(event)
            done.append(event)
        return done

    def reconcile(self, pending: Iterable[Lane], served: Callable[[Lane], bool]) -> list[ScaleEvent]:
        """For each pending lane that ``served`` says has no live worker, wake its StatefulSet."""
        events: list[ScaleEvent] = []
        for lane in pending:
            if served(lane):
                continue
            events.extend(self.wake(lane.machine_profile, lane.bundle, lane.pool))
        return events

    async def areconcile(self, pending: Iterable[Lane], served: Callable[[Lane], bool]) -> list[ScaleEvent]:
        return await asyncio.to_thread(self.reconcile, list(pending), served)

    async def run(
        self,
        pending: Callable[[], Iterable[Lane]],
        served: Callable[[Lane], bool],
        interval_s: float,
    ) -> None:
        """Reconcile every ``interval_s`` until cancelled (the gateway runs this as a task)."""
        while True:
            try:
                await self.areconcile(list(pending()), served)
            except Exception:  # noqa: BLE001 - never let the loop die
                log.exception("k8s scaler pass failed")
            await asyncio.sleep(interval_s)


def build_scaler(settings: K8sScalerSettings, api: Any | None = None) -> K8sScaler | None:
    """The scaler the gateway should run, or None when the option is off.

    Without ``api`` the in-cluster service-account configuration is loaded (falling back to
    the local kubeconfig) and an ``AppsV1Api`` is built.
    """
    if not settings.scaler_enabled:
        return None
    if api is None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        api = client.AppsV1Api()
    return K8sScaler(
        api=api,
        namespace=settings.namespace,
        targets=settings.targets(),
        min_replicas=settings.scaler_min_replicas,
        recheck_s=settings.scaler_recheck_s,
    )
