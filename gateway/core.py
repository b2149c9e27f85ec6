"""The gateway's per-process state and its request path: lifecycle, lane choice, publish and collect.

:class:`Gateway` holds the dispatcher, worker registry, pools, demand and metrics, and the NATS
tasks; the HTTP handlers in ``gateway/routes/`` call :meth:`Gateway.execute`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
import nats.js.errors
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from gateway import routing, same_items
from gateway.batches import BatchRunner, BatchStore
from gateway.dispatch import Dispatcher, WorkMessage
from gateway.dlq import DLQForwarder
from gateway.metrics import DemandTracker, GatewayMetrics
from gateway.pools import DEFAULT_POOL, PoolStore, normalize_pool_name
from gateway.registry import ModelRegistry, Route
from gateway.result_cache import ResultCache, cached_result
from gateway.routing import Lane
from gateway.settings import GatewaySettings
from gateway.workers import WorkerRegistry
from iokit import http
from iokit.payloads import HEADER as PAYLOAD_HEADER
from protocol import tracing
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.logs import bind
from protocol.priority import PRIORITY_HEADER, request_priority
from protocol.result_cache import model_config_hash, work_item_key
from protocol.streams import dlq_stream_config
from protocol.subjects import BULK, HEALTH_PREFIX, HEALTH_SOLICIT, pin_subject
from protocol.work import (
    RoutingHeader,
    WorkItem,
    WorkResult,
    chunk_plan,
    encode_own,
    encode_shared,
    pack_items,
)

log = logging.getLogger(__name__)


GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
REQUEST_ID_KEY = web.RequestKey("sie_request_id", str)


# Builds a request's work items once its lane is chosen: (lane, request_id, reply_subject, deadline_ts).
ItemBuilder = Callable[[Lane, str, str, float], list[WorkItem]]


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


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        nc: NATS,
        registry: ModelRegistry,
        *,
        router_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.registry = registry
        self.metrics = GatewayMetrics()
        self.demand = DemandTracker(self.metrics, settings.gateway_demand_expiry_s)
        self.workers = WorkerRegistry(settings.gateway_worker_stale_s)
        # (pool, profile, model, bundles) → (registry generation, valid until, lane): _served_lane
        self._lanes: dict[tuple[str, str | None, str, tuple[str, ...]], tuple[int, float, Lane]] = {}
        self.dispatcher = Dispatcher(
            nc,
            metrics=self.metrics,
            storage=settings.stream_storage,
            max_age_s=settings.stream_max_age_s,
            max_msgs=settings.stream_max_msgs,
            replicas=settings.stream_replicas,
            max_stream_pending=settings.gateway_max_stream_pending,
            publish_concurrency=settings.gateway_publish_concurrency,
            publish_timeout_s=settings.gateway_publish_timeout_s,
            direct_after_s=settings.gateway_direct_after_s,
            queue_full_retry_after_s=settings.gateway_queue_full_retry_after_s,
            bulk_share=settings.gateway_bulk_share,
            router_id=router_id,
        )
        self.pools: PoolStore | None = None
        self.cache: ResultCache | None = None
        self.computing = same_items.InFlight(
            self.metrics.cache_followed.inc
        )  # cache misses this gateway is computing, by key
        self.batches: BatchStore | None = None  # the OpenAI Batch API's files and batches
        self.batch_runner: BatchRunner | None = None
        self.dlq = DLQForwarder(nc, self.dispatcher, self.metrics)
        self._subs: list[Any] = []
        self._heard = asyncio.Event()  # a heartbeat came since the last solicit_heartbeats
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False  # background loops end on this too: library code may swallow a cancel
        self.started_at = time.time()
        self.draining = False  # set by drain(): new API requests are answered 503, /readyz fails
        self.in_flight = 0  # API requests (/v1/...) being handled, counted by the middleware

    @property
    def router_id(self) -> str:
        return self.dispatcher.router_id

    # ---- lifecycle -------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> int:
        """Stop taking API requests (each new one is answered ``503 QUEUE_UNAVAILABLE`` with a
        ``Retry-After``, which clients retry, and ``/readyz`` fails) and wait, at most ``timeout_s``,
        for those in flight to be answered. Returns how many were still in flight."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    async def start(self) -> None:
        js = self.nc.jetstream()
        await self.dispatcher.start()
        self._subs.append(await self.nc.subscribe(HEALTH_PREFIX + ".>", cb=self._on_heartbeat))
        self.heartbeats_since = time.monotonic()
        await self.solicit_heartbeats()
        try:
            await js.add_stream(
                StreamConfig(
                    **dlq_stream_config(
                        storage=self.settings.stream_storage, replicas=self.settings.stream_replicas
                    )
                )
            )
        except Exception as exc:  # exists with other settings, or JetStream busy: forwarding still works
            log.info("DEAD_LETTERS stream not (re)created: %s", exc)
        await self.dlq.start()
        self.pools = await PoolStore.open(
            js,
            self.settings.pool_bucket,
            self.workers,
            storage=self.settings.stream_storage,
            replicas=self.settings.stream_replicas,
            default_ttl_s=self.settings.pool_ttl_s,
            max_ttl_s=self.settings.pool_max_ttl_s,
            max_pools=self.settings.pool_max_count,
            known_profiles=self.known_profiles,
            known_bundles=self.registry.bundle_names,
            check_model=lambda m: self.registry.resolve(m),
            on_event=lambda e: self.metrics.pool_events.labels(e).inc(),
        )
        if self.settings.result_cache_enabled:
            self.cache = await ResultCache.open(
                js,
                self.settings.result_cache_bucket,
                self.metrics,
                ttl_s=self.settings.result_cache_ttl_s,
                max_bytes=self.settings.result_cache_max_bytes,
                max_value_bytes=self.settings.result_cache_max_value_bytes,
                storage=self.settings.stream_storage,
                replicas=self.settings.stream_replicas,
                timeout_s=self.settings.result_cache_timeout_s,
            )
        if self.settings.batch_enabled:
            self.batches = await BatchStore.open(
                js, storage=self.settings.stream_storage, replicas=self.settings.stream_replicas
            )
            self.batch_runner = BatchRunner(
                self.batches,
                self.router_id,
                lines_in_flight=self.settings.batch_lines_in_flight,
                chunk_lines=self.settings.batch_chunk_lines,
                max_lines=self.settings.batch_max_lines,
                lease_s=self.settings.batch_lease_s,
            )  # its lines go to this gateway's own URL, set once the server listens (run_batches)
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        await self.registry.start(self.nc, self.metrics)

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        with contextlib.suppress(Exception):
            await self.registry.stop()
        await self.dlq.stop()
        await self.dispatcher.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, kept until it ends (its errors are its own to log)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def run_batches(self, base_url: str) -> None:
        """Start running batches, sending their lines to ``base_url`` (this gateway's front door)."""
        if self.batch_runner is not None and self.batch_runner.base_url is None:
            self.batch_runner.base_url = base_url.rstrip("/")
            self._tasks.append(asyncio.create_task(self.batch_runner.run(), name="batches"))

    def on_reconnect(self) -> None:
        self.dispatcher.on_reconnect()
        self._spawn(self.solicit_heartbeats())  # workers gone stale while it was away: hear them now

    async def solicit_heartbeats(self) -> None:
        """Ask every sidecar for its heartbeat now. Until it hears one, a gateway knows no live
        worker and answers PROVISIONING (Retry-After 10 s) for lanes that are served: up to a
        heartbeat interval after it starts, and after a reconnect once its workers went stale."""
        self._heard.clear()
        try:
            await self.nc.publish(HEALTH_SOLICIT, b"")
        except Exception as exc:  # noqa: BLE001 - the periodic heartbeats come anyway
            log.warning("asking the workers for their heartbeats failed: %s", exc)

    async def hear_workers(self, wait_s: float, settle_s: float = 0.2) -> int:
        """Wait (at most ``wait_s``) for the first heartbeat after :meth:`solicit_heartbeats`, and
        ``settle_s`` more for the others; how many workers are healthy then. What ``serve`` does
        before it listens: replicas sharing a port get connections as soon as they listen."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), wait_s)
            await asyncio.sleep(settle_s)
        return len(self.workers.healthy())

    async def publish_pins(self) -> int:
        """Tell every healthy worker's sidecar which models its pools pin (an empty list: none), so
        that they are loaded there and never evicted; repeated each interval, so a restarted
        sidecar or a newly assigned worker learns them. Returns how many workers were told."""
        if self.pools is None:
            return 0
        pins = await self.pools.pins()
        told = 0
        for worker in self.workers.healthy():
            models = pins.get(worker.worker_id, [])
            await self.nc.publish(pin_subject(worker.worker_id), json.dumps({"models": models}).encode())
            told += 1
        return told

    async def _housekeeping(self) -> None:
        last_sweep = last_pins = 0.0
        while not self._stopping:
            await asyncio.sleep(1.0)
            try:
                self.workers.prune()
                self.demand.refresh(self.lane_served)
                now = time.monotonic()
                if self.pools is not None and now - last_sweep >= self.settings.pool_sweep_interval_s:
                    last_sweep = now
                    await self.pools.sweep()
                if now - last_pins >= self.settings.pool_pin_interval_s:
                    last_pins = now
                    await self.publish_pins()
            except Exception as exc:
                log.warning("housekeeping failed: %s", exc)

    async def _on_heartbeat(self, msg: Msg) -> None:
        worker_id = msg.subject[len(HEALTH_PREFIX) + 1 :]
        self.workers.observe(worker_id, msg.data)
        self._heard.set()

    # ---- routing ---------------------------------------------------------------------------
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
            spec = await self.pools.lookup(pool_name) if self.pools else None
            if spec is None:
                if any(w.pool == pool_name for w in self.workers.healthy()):
                    queue_pool = pool_name  # a physical queue pool with live workers
                else:
                    raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{pool_name}' not found", param="X-SIE-Pool")
            else:
                queue_pool = spec.get("queue_pool") or DEFAULT_POOL
                pool_priority = spec.get("priority")
                if spec.get("bundle") and spec["bundle"] not in [b.lower() for b in route.bundles]:
                    raise invalid_input(
                        f"Pool '{pool_name}' serves bundle '{spec['bundle']}', which cannot run '{route.model_id}'"
                    )
                assigned = self.pools.assigned(spec)  # type: ignore[union-attr]
                pool_state = self.pools.state(spec, assigned)  # type: ignore[union-attr]
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

    def cache_wanted(self, request: web.Request) -> bool:
        """Whether this request reads and writes the result cache (``X-SIE-Cache: off`` opts out)."""
        value = (request.headers.get("X-SIE-Cache") or "on").strip().lower()
        if value not in ("on", "off"):
            raise invalid_input(f"X-SIE-Cache must be 'on' or 'off', got {value!r}", param="X-SIE-Cache")
        return self.cache is not None and value == "on"

    # ---- running a request -----------------------------------------------------------------
    async def execute(
        self,
        request: web.Request,
        route: Route,
        operation: str,
        build: ItemBuilder,
    ) -> tuple[str, list[WorkResult], float, Lane]:
        """Route, answer what the result cache holds, publish the rest and collect.

        ``build(lane, request_id, reply, deadline_ts)`` → list[WorkItem]. Items found in the cache are
        not published; the results of the others are stored for the next request. Traced as
        ``gateway.request`` (continuing the client's ``traceparent``); the work items carry its
        context, so every later hop of the request is in the same trace.
        """
        with tracing.span(
            "gateway.request",
            parent=request.headers.get("traceparent"),
            parent_state=request.headers.get("tracestate"),
            attributes={"model": route.model_id, "operation": operation},
        ) as span:
            return await self._execute(request, route, operation, build, span)

    async def _execute(
        self, request: web.Request, route: Route, operation: str, build: ItemBuilder, span: Any
    ) -> tuple[str, list[WorkResult], float, Lane]:
        pool_name, profile = self.routing_headers(request)
        use_cache = self.cache_wanted(request)
        if not self.nc.is_connected:
            raise SIEError(
                ErrorCode.QUEUE_UNAVAILABLE, "Work queue is not connected; retry later", retry_after=2
            )
        lane = await self.choose_lane(route, pool_name, profile, request)
        request_id = http.new_request_id()
        request[REQUEST_ID_KEY] = request_id
        timeout = self.settings.gateway_request_timeout_s
        t0 = time.monotonic()
        items = build(lane, request_id, self.dispatcher.reply_subject(request_id), time.time() + timeout)
        tracing.set_attributes(
            span,
            pool=lane.pool,
            machine_profile=lane.machine_profile,
            bundle=lane.bundle,
            profile=route.resolved.profile_name,
            request_id=request_id,
            items=len(items),
        )
        keys: list[str | None] = []
        known: list[WorkResult | None] = [None] * len(items)
        if use_cache and self.cache is not None:
            config_hash = model_config_hash(route.resolved.config)
            keys = [work_item_key(item, config_hash) for item in items]
            for i, entry in enumerate(await self.cache.lookup(keys)):
                if entry is not None:
                    known[i] = same_items.answer_for(cached_result(request_id, i, entry), items[i])
        # an item equal to an earlier one of the request waits for that one's answer; a miss that a
        # concurrent request of this gateway is computing waits for that one (when caching)
        copies = same_items.duplicates(items, known) if len(items) > 1 else {}
        for i in copies:
            known[i] = same_items.COPY
        followed, led = self.computing.claim(keys, known) if keys else ({}, [])
        for i in followed:
            known[i] = same_items.COPY
        todo = [item for item, done in zip(items, known, strict=True) if done is None]
        if not todo and not followed:  # every item answered from the cache: nothing to publish
            hits = [r for r in known if r is not None]
            return request_id, hits, (time.monotonic() - t0) * 1000.0, lane
        results: list[WorkResult] | None = None
        try:
            if todo:
                results = await self._compute(
                    request, route, operation, lane, request_id, t0 + timeout, todo, known
                )
            else:  # cache hits, copies and followed items: every slot is set
                results = [r for r in known if r is not None]
        finally:
            if led:
                self.computing.settle(led, keys, results)
        if followed:
            again = []
            for i, answer in (await self.computing.follow(followed, t0 + timeout)).items():
                if answer is not None:
                    results[i] = same_items.answer_for(answer, items[i])
                else:
                    again.append(items[i])  # its computation failed there: this request computes it
            if again:
                slots: list[WorkResult | None] = list(results)
                for item in again:
                    slots[item.item_index] = None
                todo += again
                results = await self._compute(
                    request, route, operation, lane, request_id, t0 + timeout, again, slots
                )
        for i, j in copies.items():
            results[i] = same_items.answer_for(results[j], items[i])
        self.demand.clear(lane.machine_profile, lane.bundle, lane.pool)
        self.demand.clear("any", lane.bundle, lane.pool)
        if keys and self.cache is not None:
            fresh: list[tuple[str, WorkResult]] = []
            for item in todo:
                key = keys[item.item_index]
                if key is not None:
                    fresh.append((key, results[item.item_index]))
            await self.cache.store(fresh)
        return request_id, results, (time.monotonic() - t0) * 1000.0, lane

    async def _compute(
        self,
        request: web.Request,
        route: Route,
        operation: str,
        lane: Lane,
        request_id: str,
        deadline: float,
        todo: list[WorkItem],
        known: list[WorkResult | None],
    ) -> list[WorkResult]:
        """Publish ``todo`` (the request's items not ``known``) and collect every result."""
        try:
            await self.dispatcher.ensure_stream(lane.pool)
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            raise _queue_unavailable(exc) from None
        group = todo[0].group_key  # a request's items share every parameter: one group key, derived once
        for item in todo:
            item.batch_key = group
        # The messages that carry the items: chunks of up to gateway_work_chunk_items (one publish,
        # ack and delivery each), split evenly over the pods pulling the lane so that a big request
        # still runs on all of them; an item too large to share a message travels alone. Where every
        # pod on the lane reads them, chunks carry what the items share once (protocol.work H_ITEMS).
        lane_workers = routing.lane_pullers(self.workers.healthy(), lane) if len(todo) > 1 else []
        pullers = len(lane_workers) if len(todo) > 1 else 1
        shared = None
        if lane_workers and all(w.heartbeat.shared_chunks is True for w in lane_workers):
            shared = encode_shared(todo[0])
        # encoded once: checked here, published as is (an item of the shared form alone in its
        # message is encoded whole there)
        payloads = [encode_own(item) if shared else item.to_msgpack() for item in todo]
        per_message = min(self.settings.gateway_work_chunk_items, -(-len(todo) // max(1, pullers)))
        limit = self._message_limit()
        room = (limit or 1 << 62) - (len(shared) if shared else 0)
        plan = chunk_plan([len(p) for p in payloads], per_message, max(1, room))
        try:
            await self.dispatcher.check_capacity(
                lane.pool, len(todo), messages=len(plan), priority=lane.priority
            )
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            raise _queue_unavailable(exc) from None
        messages = await self._messages(todo, payloads, shared, plan, limit, one_puller=pullers == 1)
        try:
            with bind(
                request_id=request_id,
                trace_id=tracing.current_trace_id()
                or tracing.trace_id_of(request.headers.get("traceparent")),
            ):
                return await self.dispatcher.run(
                    request_id, lane, route.model_id, messages, operation=operation,
                    deadline=deadline, known=known,
                )  # fmt: skip
        finally:
            offloaded = [m.offloaded for m in messages if m.offloaded is not None]
            if offloaded:  # the workers have read them (or never will): not kept for the bucket's max age
                self._spawn(self._forget_payloads(offloaded))

    def _message_limit(self) -> int:
        """The most bytes a work message's body may take (0: the connection does not say)."""
        max_payload = getattr(self.nc, "max_payload", 0) or 0
        return max(1, max_payload - 4096) if max_payload else 0  # headers and subject travel with it

    async def _messages(
        self,
        todo: list[WorkItem],
        payloads: list[bytes],
        shared: bytes | None,
        plan: list[list[int]],
        limit: int,
        *,
        one_puller: bool,
    ) -> list[WorkMessage]:
        """The work messages of ``plan`` (indices into ``todo``; ``payloads``: their encodings, each
        item's own fields when ``shared`` holds what they share). An item over the NATS max payload
        goes into the payload store, its message left with an empty body and a header naming the
        object (iokit.payloads). With one pod on the lane, each message also says how many of the
        request's items that pod will see, so that it can batch them together."""
        together = len(todo) if one_puller else 1
        results = self.dispatcher.results_subject
        messages: list[WorkMessage] = []
        for run in plan:
            if len(run) > 1:
                items = [todo[i] for i in run]
                headers = RoutingHeader.chunk_headers(items, max(together, len(run)), results)
                messages.append(
                    WorkMessage(
                        tuple(it.item_index for it in items),
                        pack_items([payloads[i] for i in run], shared),
                        headers,
                    )
                )
                continue
            item = todo[run[0]]
            payload = item.to_msgpack() if shared else payloads[run[0]]
            headers = RoutingHeader.headers_of(item, together, results)
            offloaded = None
            if limit and len(payload) > limit:
                try:
                    await self.dispatcher.payloads.put(item.work_item_id, payload)
                except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                    raise SIEError(
                        ErrorCode.QUEUE_UNAVAILABLE,
                        f"Item {item.item_index} is {len(payload)} bytes, more than one queue message takes, and "
                        f"the payload store did not take it ({type(exc).__name__}); retry later",
                        retry_after=2,
                    ) from None
                offloaded, payload = item.work_item_id, b""
                headers[PAYLOAD_HEADER] = item.work_item_id
                self.metrics.payload_offloads.inc()
            messages.append(WorkMessage((item.item_index,), payload, headers, offloaded))
        return messages

    async def _forget_payloads(self, names: list[str]) -> None:
        for name in names:
            try:
                await self.dispatcher.payloads.delete(name)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:  # the bucket's max age takes it
                log.debug("payload %s not deleted: %s", name, exc)

    def work_items(
        self,
        *,
        lane: Lane,
        route: Route,
        request_id: str,
        reply: str,
        deadline_ts: float,
        operation: str,
        items: list[dict[str, Any] | None],
        **fields: Any,
    ) -> list[WorkItem]:
        """The work items of a request: one per entry of ``items`` (its ``item``; score: one, None),
        every other field the request's."""
        return WorkItem(
            work_item_id="",
            request_id=request_id,
            item_index=0,
            total_items=len(items),
            operation=operation,
            model_id=route.model_id,
            profile_id=route.resolved.profile_name,
            pool_name=lane.pool,
            machine_profile=lane.machine_profile,
            router_id=self.router_id,
            reply_subject=reply,
            timestamp=time.time(),
            bundle_config_hash=self.registry.bundle_hash(lane.bundle) or None,
            deadline=deadline_ts,
            bundle=lane.bundle,
            traceparent=tracing.traceparent(),
            **fields,
        ).per_item(items)


def _queue_unavailable(exc: BaseException) -> SIEError:
    return SIEError(
        ErrorCode.QUEUE_UNAVAILABLE,
        f"Work queue unavailable ({type(exc).__name__}); retry later",
        retry_after=2,
    )
