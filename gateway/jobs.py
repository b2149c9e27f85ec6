"""The work of a request: the job of its operation (protocol.jobs) built once its lane is chosen, its
items' cache keys, and the work messages that carry them (protocol.work_codec: one item, or a chunk
of them; a body too large for NATS in the payload store); a dead-lettered message read back. The one
module of the gateway that builds jobs and messages; the result inbox (:mod:`gateway.inbox`) reads
the results.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from prometheus_client import Counter

from gateway import routing
from gateway.registry import Route
from gateway.routing import Lane
from gateway.workers import WorkerRecord
from iokit.payloads import PayloadStore
from protocol import tracing
from protocol.errors import ErrorCode, SIEError
from protocol.jobs import Input, Job, JobItem, job_items
from protocol.model_config import ModelConfig
from protocol.result_cache import job_item_keys, model_config_hash
from protocol.work_codec import WorkCodec, WorkMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobRequest:
    """What a route asks the workers to do, parsed and checked: ``make`` builds the job of its
    operation from the routing fields (its params bound, e.g. ``partial(EncodeJob, params=...)``),
    over each of ``inputs``."""

    operation: str
    make: Callable[..., Job]
    inputs: Sequence[Input]


@dataclass(frozen=True)
class MessagePlan:
    """How a request's items (``todo``) travel: ``messages``, and ``limit`` the most bytes a
    message's body may take (0: not known); a body over it goes to the payload store."""

    todo: list[JobItem]
    messages: list[WorkMessage]
    limit: int


def cache_keys(items: list[JobItem], config: ModelConfig) -> list[str | None]:
    """The result-cache key of each of ``items`` (of a model of ``config``)."""
    return list(job_item_keys(items, model_config_hash(config)))


def dead_items(data: bytes, router_id: str) -> list[tuple[str, int]]:
    """(request id, item index) of each item that gateway ``router_id`` sent in a work message's
    body (one item, or a chunk's); ValueError when it holds no job."""
    return [(it.request_id, it.index) for it in WorkCodec.items_of(data) if it.job.router_id == router_id]


class JobBuilder:
    """Builds the jobs and messages of this gateway's requests."""

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

    def job_items(
        self, req: JobRequest, *, lane: Lane, route: Route, request_id: str, reply: str, deadline_ts: float
    ) -> list[JobItem]:
        """The items of a request: its job, built here once, with each of its inputs."""
        job = req.make(
            request_id=request_id,
            model_id=route.model_id,
            profile_id=route.resolved.profile_name,
            pool_name=lane.pool,
            machine_profile=lane.machine_profile,
            router_id=self.router_id,
            reply_subject=reply,
            timestamp=time.time(),
            total_items=len(req.inputs),
            deadline=deadline_ts,
            bundle=lane.bundle,
            bundle_config_hash=self._bundle_hash(lane.bundle) or None,
            traceparent=tracing.traceparent(),
        )
        return job_items(job, req.inputs)

    def plan(self, lane: Lane, todo: list[JobItem]) -> MessagePlan:
        """The messages that carry ``todo`` (the request's items to publish): chunks of up to
        ``chunk_items`` (one publish, ack and delivery each), split evenly over the pods pulling the
        lane so that a big request still runs on all of them; an item too large to share a message
        travels alone. With one pod on the lane, each message also says how many of the request's
        items that pod will see, so that it can batch them together."""
        pullers = len(routing.lane_pullers(self._healthy(), lane)) if len(todo) > 1 else 1
        per_message = min(self.chunk_items, -(-len(todo) // max(1, pullers)))
        limit = self._message_limit()
        messages = WorkCodec.messages(
            todo,
            per_message=per_message,
            max_bytes=limit or 1 << 62,
            request_items=len(todo) if pullers == 1 else 1,
            results_subject=self.results_subject,
        )
        return MessagePlan(todo, messages, limit)

    def _message_limit(self) -> int:
        """The most bytes a work message's body may take (0: the connection does not say)."""
        max_payload = self._max_payload()
        return max(1, max_payload - 4096) if max_payload else 0  # headers and subject travel with it

    async def messages(self, plan: MessagePlan) -> list[WorkMessage]:
        """The messages of ``plan``, a body over the NATS max payload put into the payload store
        (the message then empty, with a header naming the object: iokit.payloads)."""
        out: list[WorkMessage] = []
        for msg in plan.messages:
            if not plan.limit or len(msg.payload) <= plan.limit:
                out.append(msg)
                continue
            name = f"{plan.todo[0].request_id}.{msg.slots[0]}"
            try:
                await self.payloads.put(name, msg.payload)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                raise SIEError(
                    ErrorCode.QUEUE_UNAVAILABLE,
                    f"Item {msg.slots[0]} is {len(msg.payload)} bytes, more than one queue message takes, and "
                    f"the payload store did not take it ({type(exc).__name__}); retry later",
                    retry_after=2,
                ) from None
            out.append(WorkCodec.offloaded(msg, name))
            self._offloads.inc()
        return out

    async def forget_payloads(self, names: list[str]) -> None:
        """Delete the payload-store objects ``names``: the workers have read them (or never will),
        not kept for the bucket's max age."""
        for name in names:
            try:
                await self.payloads.delete(name)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:  # the bucket's max age takes it
                log.debug("payload %s not deleted: %s", name, exc)
