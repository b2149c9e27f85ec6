"""Lane choice: which lane (pool, machine profile, bundle, priority class) a request's work goes to,
from its routing headers, its pool's spec and the healthy workers; PROVISIONING when none serves it.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway import routing
from gateway.metrics import DemandTracker
from gateway.pool_spec import DEFAULT_POOL, normalize_pool_name
from gateway.pools import PoolStore
from gateway.registry import Route
from gateway.routing import Lane
from gateway.settings import GatewaySettings
from gateway.workers import WorkerRegistry
from iokit import http
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.priority import PRIORITY_HEADER, request_priority
from protocol.subjects import BULK


class Provisioning(SIEError):
    """No healthy worker can serve the lane yet (scale from zero, or a pool still pending).

    A PROVISIONING error; how it is answered (202 or 503) depends on the client, see
    :func:`gateway.http_common.provisioning_response`.
    """

    def __init__(
        self, machine_profile: str | None, bundle: str, pool: str, message: str, *, retry_after: float
    ) -> None:
        super().__init__(
            ErrorCode.PROVISIONING,
            message,
            retry_after=retry_after,
            gpu=machine_profile,
            bundle=bundle,
            pool=pool,
        )
        self.machine_profile = machine_profile
        self.bundle = bundle
        self.pool = pool


class LaneChooser:
    def __init__(
        self,
        settings: GatewaySettings,
        workers: WorkerRegistry,
        demand: DemandTracker,
        pools: Callable[[], PoolStore | None],
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.demand = demand
        self._pools = pools  # the pool store, once the gateway has opened it
        # (pool, profile, model, bundles) → (registry generation, valid until, lane): _served_lane
        self._lanes: dict[tuple[str, str | None, str, tuple[str, ...]], tuple[int, float, Lane]] = {}

    def known_profiles(self) -> list[str]:
        return sorted(set(self.settings.configured_gpus()) | set(self.workers.live_profiles()))

    def lane_served(self, lane: Lane) -> bool:
        """True when a healthy worker of ``lane``'s pool serves its profile ("any"/"" = any profile)
        and bundle."""
        return routing.lane_served(self.workers.healthy(), lane)

    def canonical_profile(self, value: str | None) -> str | None:
        if not value:  # most requests name no profile: no list of the live ones to build
            return None
        return routing.canonical_profile(value, self.settings.configured_gpus(), self.workers.live_profiles())

    def routing_headers(self, request: web.Request) -> tuple[str | None, str | None]:
        pool, profile = routing.split_routing_headers(
            request.headers.get("X-SIE-MACHINE-PROFILE"), request.headers.get("X-SIE-Pool")
        )
        return (normalize_pool_name(pool) if pool else None), self.canonical_profile(profile)

    async def choose_lane(
        self, route: Route, pool_name: str | None, profile: str | None, request: web.Request
    ) -> Lane:
        """The lane of ``route`` in the pool and profile asked for, with the request's priority class
        (its ``X-SIE-Priority``, else its token's, else the pool's, else the gateway's default)."""
        queue_pool = DEFAULT_POOL
        assigned_ids: set[str] | None = None
        pool_state = "active"
        pool_priority: str | None = None
        if pool_name and pool_name != DEFAULT_POOL:
            pools = self._pools()
            spec = await pools.lookup(pool_name) if pools else None
            if pools is None or spec is None:
                if any(w.pool == pool_name for w in self.workers.healthy()):
                    queue_pool = pool_name  # a physical queue pool with live workers
                else:
                    raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{pool_name}' not found", param="X-SIE-Pool")
            else:
                queue_pool = spec.queue_pool or DEFAULT_POOL
                pool_priority = spec.priority
                if spec.bundle and spec.bundle not in [b.lower() for b in route.bundles]:
                    raise invalid_input(
                        f"Pool '{pool_name}' serves bundle '{spec.bundle}', which cannot run '{route.model_id}'"
                    )
                assigned = pools.assigned(spec)
                pool_state = pools.state(spec, assigned)
                assigned_ids = {w.worker_id for w in assigned}
        lane = self._served_lane(route, queue_pool, profile, assigned_ids)
        if lane is None or pool_state != "active":
            bundle = route.bundles[0]
            self.demand.record(profile or "any", bundle, queue_pool)
            raise Provisioning(
                profile,
                bundle,
                queue_pool,
                routing.provisioning_message(route.model_id, profile, pool_name),
                retry_after=self.settings.gateway_provisioning_retry_after_s,
            )
        priority = request_priority(
            request.headers.get(PRIORITY_HEADER),
            self.token_priority(request),
            pool_priority or self.settings.gateway_default_priority,
        )
        return (
            lane
            if lane.priority == priority
            else Lane(lane.pool, lane.machine_profile, lane.bundle, priority)
        )

    def _served_lane(
        self, route: Route, queue_pool: str, profile: str | None, assigned_ids: set[str] | None
    ) -> Lane | None:
        """The best lane of the healthy workers that can serve ``route`` (None: there is none).
        Outside a pool with assigned workers the choice is kept until the worker registry changes (a
        heartbeat, a worker gone) or a worker it was made from would turn stale: it depends on nothing
        else, and every request asks for it."""
        key = (
            None if assigned_ids is not None else (queue_pool, profile, route.model_id, tuple(route.bundles))
        )
        if key is not None:
            kept = self._lanes.get(key)
            if kept is not None and kept[0] == self.workers.generation and self.workers.now() < kept[1]:
                return kept[2]
        candidates = self.workers.select(
            pool=queue_pool, profile=profile, bundles=route.bundles, model_id=route.model_id
        )
        if assigned_ids is not None:
            candidates = [w for w in candidates if w.worker_id in assigned_ids]
        if not candidates:
            return None
        lane = routing.best_lane(route.model_id, route.bundles, queue_pool, candidates)
        if key is not None:
            self._lanes[key] = (self.workers.generation, self.workers.healthy_until(candidates), lane)
        return lane

    def token_priority(self, request: web.Request) -> str | None:
        """``bulk`` for a request authenticated with one of ``SIE_AUTH_BULK_TOKENS``."""
        if not self.settings.auth_bulk_tokens:
            return None
        token = http.bearer_token(request.headers.get("Authorization"))
        return (
            BULK if token is not None and http.token_matches(token, self.settings.auth_bulk_tokens) else None
        )
