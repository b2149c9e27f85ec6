"""The work messages of a request: its items built from what the route asked (a :class:`Job`),
encoded once, cut into the messages that carry them (one item, or a chunk of them), and read back
from a dead-lettered message. The one module of the gateway that writes work items and reads their
message forms (protocol.work); the result inbox (:mod:`gateway.inbox`) reads the results.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from prometheus_client import Counter

from gateway import routing
from gateway.registry import Route
from gateway.routing import Lane
from gateway.workers import WorkerRecord
from iokit.payloads import HEADER as PAYLOAD_HEADER
from iokit.payloads import PayloadStore
from protocol import tracing
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig
from protocol.result_cache import model_config_hash, work_item_key
from protocol.work import (
    H_TAKEN,
    MSG_ID,
    RoutingHeader,
    WorkItem,
    chunk_plan,
    encode_own,
    encode_shared,
    pack_items,
    redispatch_msg_id,
    work_items_of,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What a route asks the workers to do: ``operation`` over each of ``items`` (its ``item``;
    score: one, None), with the request's parameters (each as a work item's field of that name)."""

    operation: str
    items: list[dict[str, Any] | None]
    options: dict[str, Any] = field(default_factory=dict)
    output_types: list[str] | None = None
    output_dtype: str | None = None
    instruction: str | None = None
    is_query: bool = False
    query_item: dict[str, Any] | None = None
    score_items: list[dict[str, Any]] | None = None
    labels: list[str] | None = None
    output_schema: dict[str, Any] | None = None


@dataclass
class WorkMessage:
    """One work message of a request: the slots of the items it carries (one, or a chunk's), its
    body and headers (protocol.work), and the payload-store object its one item went to, if any."""

    slots: tuple[int, ...]
    payload: bytes
    headers: dict[str, str]
    offloaded: str | None = None

    def again(self, attempt: int) -> dict[str, str]:
        """Its headers for its ``attempt``-th publish again: a new message id, past the stream's
        duplicate window."""
        return {**self.headers, MSG_ID: redispatch_msg_id(self.headers.get(MSG_ID, ""), attempt)}

    def direct(self, taken: str) -> dict[str, str]:
        """Its headers on the direct path: the sidecar that takes it says so on ``taken``."""
        return {**self.headers, H_TAKEN: taken}


@dataclass
class MessagePlan:
    """How a request's items (``todo``) travel: ``payloads`` their encodings (each item's own fields
    when ``shared`` holds what they share), ``runs`` the indices into ``todo`` of each message, and
    ``limit`` the most bytes a message's body may take (0: not known)."""

    todo: list[WorkItem]
    payloads: list[bytes]
    shared: bytes | None
    runs: list[list[int]]
    limit: int
    one_puller: bool


def cache_keys(items: list[WorkItem], config: ModelConfig) -> list[str | None]:
    """The result-cache key of each of ``items`` (of a model of ``config``); None where an item's
    content is not inline."""
    config_hash = model_config_hash(config)
    return [work_item_key(item, config_hash) for item in items]


def dead_items(data: bytes, router_id: str) -> list[tuple[str, int]]:
    """(request id, item index) of each item that gateway ``router_id`` sent in a work message's
    body (one item, or a chunk's); ValueError (or a decoding error) when it holds no work items."""
    return [(it.request_id, it.item_index) for it in work_items_of(data) if it.router_id == router_id]


class JobBuilder:
    """Builds the work items and messages of this gateway's requests."""

    def __init__(
        self,
        *,
        router_id: str,
        results_subject: str,
        bundle_hash: Callable[[str], str],
        healthy: Callable[[], list[WorkerRecord]],
        payloads: PayloadStore,
        offloads: Counter,
        max_payload: Callable[[], int],
        chunk_items: int,
    ) -> None:
        self.router_id = router_id
        self.results_subject = results_subject  # where sidecars send several results in one message
        self._bundle_hash = bundle_hash
        self._healthy = healthy
        self.payloads = payloads
        self._offloads = offloads
        self._max_payload = max_payload
        self.chunk_items = chunk_items

    def work_items(
        self, job: Job, *, lane: Lane, route: Route, request_id: str, reply: str, deadline_ts: float
    ) -> list[WorkItem]:
        """The work items of a request: one per entry of ``job.items``, every other field the request's."""
        return WorkItem(
            work_item_id="",
            request_id=request_id,
            item_index=0,
            total_items=len(job.items),
            operation=job.operation,
            model_id=route.model_id,
            profile_id=route.resolved.profile_name,
            pool_name=lane.pool,
            machine_profile=lane.machine_profile,
            router_id=self.router_id,
            reply_subject=reply,
            timestamp=time.time(),
            bundle_config_hash=self._bundle_hash(lane.bundle) or None,
            output_types=job.output_types,
            output_dtype=job.output_dtype,
            instruction=job.instruction,
            is_query=job.is_query,
            options=job.options,
            query_item=job.query_item,
            score_items=job.score_items,
            labels=job.labels,
            output_schema=job.output_schema,
            deadline=deadline_ts,
            bundle=lane.bundle,
            traceparent=tracing.traceparent(),
        ).per_item(job.items)

    def plan(self, lane: Lane, todo: list[WorkItem]) -> MessagePlan:
        """The messages that carry ``todo`` (the request's items to publish): chunks of up to
        ``chunk_items`` (one publish, ack and delivery each), split evenly over the pods pulling the
        lane so that a big request still runs on all of them; an item too large to share a message
        travels alone. Where every pod on the lane reads them, chunks carry what the items share
        once (protocol.work H_ITEMS)."""
        group = todo[0].group_key  # a request's items share every parameter: one group key, derived once
        for item in todo:
            item.batch_key = group
        lane_workers = routing.lane_pullers(self._healthy(), lane) if len(todo) > 1 else []
        pullers = len(lane_workers) if len(todo) > 1 else 1
        shared = None
        if lane_workers and all(w.heartbeat.shared_chunks is True for w in lane_workers):
            shared = encode_shared(todo[0])
        # encoded once: checked here, published as is (an item of the shared form alone in its
        # message is encoded whole there)
        payloads = [encode_own(item) if shared else item.to_msgpack() for item in todo]
        per_message = min(self.chunk_items, -(-len(todo) // max(1, pullers)))
        limit = self._message_limit()
        room = (limit or 1 << 62) - (len(shared) if shared else 0)
        runs = chunk_plan([len(p) for p in payloads], per_message, max(1, room))
        return MessagePlan(todo, payloads, shared, runs, limit, one_puller=pullers == 1)

    def _message_limit(self) -> int:
        """The most bytes a work message's body may take (0: the connection does not say)."""
        max_payload = self._max_payload()
        return max(1, max_payload - 4096) if max_payload else 0  # headers and subject travel with it

    async def messages(self, plan: MessagePlan) -> list[WorkMessage]:
        """The work messages of ``plan``. An item over the NATS max payload goes into the payload
        store, its message left with an empty body and a header naming the object (iokit.payloads).
        With one pod on the lane, each message also says how many of the request's items that pod
        will see, so that it can batch them together."""
        todo, payloads, shared, limit = plan.todo, plan.payloads, plan.shared, plan.limit
        together = len(todo) if plan.one_puller else 1
        results = self.results_subject
        messages: list[WorkMessage] = []
        for run in plan.runs:
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
                    await self.payloads.put(item.work_item_id, payload)
                except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                    raise SIEError(
                        ErrorCode.QUEUE_UNAVAILABLE,
                        f"Item {item.item_index} is {len(payload)} bytes, more than one queue message takes, and "
                        f"the payload store did not take it ({type(exc).__name__}); retry later",
                        retry_after=2,
                    ) from None
                offloaded, payload = item.work_item_id, b""
                headers[PAYLOAD_HEADER] = item.work_item_id
                self._offloads.inc()
            messages.append(WorkMessage((item.item_index,), payload, headers, offloaded))
        return messages

    async def forget_payloads(self, names: list[str]) -> None:
        """Delete the payload-store objects ``names``: the workers have read them (or never will),
        not kept for the bucket's max age."""
        for name in names:
            try:
                await self.payloads.delete(name)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:  # the bucket's max age takes it
                log.debug("payload %s not deleted: %s", name, exc)
