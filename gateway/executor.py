"""Running one request: its lane chosen, what the result cache holds answered from there, equal
items computed once (and misses another request of this gateway is computing waited for), the rest
published and collected, and the fresh results stored for the next request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from aiohttp import web

from gateway import same_items
from gateway.dispatch import Dispatcher
from gateway.jobs import JobBuilder, JobRequest, cache_keys
from gateway.lanes import LaneChooser
from gateway.metrics import DemandTracker
from gateway.registry import Route
from gateway.result_cache import ResultCache, cached_result
from gateway.routing import Lane
from gateway.streams import StreamAdmin
from iokit import http
from protocol import tracing
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.jobs import JobItem
from protocol.logs import bind
from protocol.work import WorkResult

REQUEST_ID_KEY = web.RequestKey("sie_request_id", str)


@dataclass(frozen=True)
class _Run:
    """One request's work once its lane is chosen."""

    route: Route
    operation: str
    lane: Lane
    request_id: str
    deadline: float  # time.monotonic()
    traceparent: str | None  # the client's


class Executor:
    def __init__(
        self,
        *,
        lanes: LaneChooser,
        jobs: JobBuilder,
        streams: StreamAdmin,
        dispatcher: Dispatcher,
        cache: Callable[[], ResultCache | None],
        computing: same_items.InFlight,
        demand: DemandTracker,
        connected: Callable[[], bool],
        timeout_s: float,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.lanes = lanes
        self.jobs = jobs
        self.streams = streams
        self.dispatcher = dispatcher
        self._cache = cache  # the result cache, once the gateway has opened it (None: off)
        self.computing = computing  # cache misses this gateway is computing, by key
        self.demand = demand
        self._connected = connected
        self.timeout_s = timeout_s
        self._spawn = spawn

    def cache_wanted(self, request: web.Request) -> bool:
        """Whether this request reads and writes the result cache (``X-SIE-Cache: off`` opts out)."""
        value = (request.headers.get("X-SIE-Cache") or "on").strip().lower()
        if value not in ("on", "off"):
            raise invalid_input(f"X-SIE-Cache must be 'on' or 'off', got {value!r}", param="X-SIE-Cache")
        return self._cache() is not None and value == "on"

    async def execute(
        self, request: web.Request, route: Route, job: JobRequest
    ) -> tuple[str, list[WorkResult], float, Lane]:
        """Route, answer what the result cache holds, publish the rest and collect.

        Items found in the cache are not published; the results of the others are stored for the
        next request. Traced as ``gateway.request`` (continuing the client's ``traceparent``); the
        work items carry its context, so every later hop of the request is in the same trace.
        """
        with tracing.span(
            "gateway.request",
            parent=request.headers.get("traceparent"),
            parent_state=request.headers.get("tracestate"),
            attributes={"model": route.model_id, "operation": job.operation},
        ) as span:
            return await self._execute(request, route, job, span)

    async def _execute(
        self, request: web.Request, route: Route, job: JobRequest, span: Any
    ) -> tuple[str, list[WorkResult], float, Lane]:
        pool_name, profile = self.lanes.routing_headers(request)
        use_cache = self.cache_wanted(request)
        if not self._connected():
            raise SIEError(
                ErrorCode.QUEUE_UNAVAILABLE, "Work queue is not connected; retry later", retry_after=2
            )
        lane = await self.lanes.choose_lane(route, pool_name, profile, request)
        request_id = http.new_request_id()
        request[REQUEST_ID_KEY] = request_id
        t0 = time.monotonic()
        reply = self.dispatcher.inbox.reply_subject(request_id)
        items = self.jobs.job_items(
            job, lane=lane, route=route, request_id=request_id, reply=reply, deadline_ts=time.time() + self.timeout_s
        )  # fmt: skip
        tracing.set_attributes(
            span,
            pool=lane.pool,
            machine_profile=lane.machine_profile,
            bundle=lane.bundle,
            profile=route.resolved.profile_name,
            request_id=request_id,
            items=len(items),
        )
        run = _Run(
            route, job.operation, lane, request_id, t0 + self.timeout_s, request.headers.get("traceparent")
        )
        cache = self._cache() if use_cache else None
        known: list[WorkResult | None] = [None] * len(items)
        keys = await self._look_up(cache, run, items, known) if cache is not None else []
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
                results = await self._compute(run, todo, known)
            else:  # cache hits, copies and followed items: every slot is set
                results = [r for r in known if r is not None]
        finally:
            if led:
                self.computing.settle(led, keys, results)
        if followed:
            results, again = await self._follow(run, items, followed, results)
            todo += again
        for i, j in copies.items():
            results[i] = same_items.answer_for(results[j], items[i])
        self.demand.clear(lane.machine_profile, lane.bundle, lane.pool)
        self.demand.clear("any", lane.bundle, lane.pool)
        if keys and cache is not None:
            fresh: list[tuple[str, WorkResult]] = []
            for item in todo:
                key = keys[item.item_index]
                if key is not None:
                    fresh.append((key, results[item.item_index]))
            await cache.store(fresh)
        return request_id, results, (time.monotonic() - t0) * 1000.0, lane

    async def _look_up(
        self, cache: ResultCache, run: _Run, items: list[JobItem], known: list[WorkResult | None]
    ) -> list[str | None]:
        """The cache keys of ``items``; the answers the cache holds set in ``known``."""
        keys = cache_keys(items, run.route.resolved.config)
        for i, entry in enumerate(await cache.lookup(keys)):
            if entry is not None:
                known[i] = same_items.answer_for(cached_result(run.request_id, i, entry), items[i])
        return keys

    async def _follow(
        self,
        run: _Run,
        items: list[JobItem],
        followed: dict[int, asyncio.Future[WorkResult | None]],
        results: list[WorkResult],
    ) -> tuple[list[WorkResult], list[JobItem]]:
        """``results`` with the answers of the ``followed`` items (computed by another request of
        this gateway) filled in; those whose computation failed there computed here, and returned."""
        again = []
        for i, answer in (await self.computing.follow(followed, run.deadline)).items():
            if answer is not None:
                results[i] = same_items.answer_for(answer, items[i])
            else:
                again.append(items[i])  # its computation failed there: this request computes it
        if again:
            slots: list[WorkResult | None] = list(results)
            for item in again:
                slots[item.item_index] = None
            results = await self._compute(run, again, slots)
        return results, again

    async def _compute(
        self, run: _Run, todo: list[JobItem], known: list[WorkResult | None]
    ) -> list[WorkResult]:
        """Publish ``todo`` (the request's items not ``known``) and collect every result."""
        lane = run.lane
        try:
            await self.streams.ensure_stream(lane.pool)
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            raise _queue_unavailable(exc) from None
        plan = self.jobs.plan(lane, todo)
        try:
            await self.streams.check_capacity(
                lane.pool, len(todo), messages=len(plan.messages), priority=lane.priority
            )
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            raise _queue_unavailable(exc) from None
        messages = await self.jobs.messages(plan)
        try:
            with bind(
                request_id=run.request_id,
                trace_id=tracing.current_trace_id() or tracing.trace_id_of(run.traceparent),
            ):
                return await self.dispatcher.run(
                    run.request_id, lane, run.route.model_id, messages, operation=run.operation,
                    deadline=run.deadline, known=known,
                )  # fmt: skip
        finally:
            offloaded = [m.offloaded for m in messages if m.offloaded is not None]
            if offloaded:  # the workers have read them (or never will): not kept for the bucket's max age
                self._spawn(self.jobs.forget_payloads(offloaded))


def _queue_unavailable(exc: BaseException) -> SIEError:
    return SIEError(
        ErrorCode.QUEUE_UNAVAILABLE,
        f"Work queue unavailable ({type(exc).__name__}); retry later",
        retry_after=2,
    )
