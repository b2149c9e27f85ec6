"""The one codec of the cluster path: jobs into NATS work messages, messages into what the sidecar
batches, batches into the IPC RunBatch body, that body into jobs on the worker, results into
messages and back. Nothing else knows a body form or a header of the path.

A work message carries one or more items of one job (a chunk). Its body takes one form::

    [<job>, [<input>, ...]]          msgpack array; <job>, each <input>: msgpack maps, as bytes

``<job>`` is the job without its inputs (ids, inboxes, model, checked params, timestamps, trace
context: most of an item's bytes), once per message; each ``<input>`` is ``{"i": index, "item":
item}`` (a score job's one input: ``{"i": 0, "query": item, "items": [item, ...]}``). The sidecar
never decodes them: it hands both, as bytes, to the worker (each job's once per batch), which
decodes each job once. A message too large for NATS leaves its body in the payload store
(iokit.payloads), under the name its ``Sie-Payload`` header gives, and travels empty.

Its headers are what the sidecar routes, batches, cancels and settles it by: ``Nats-Msg-Id`` (a
publish sent again after a reconnect lands in the stream once), ``Sie-Route`` (a JSON array of what
its items share, :data:`_ROUTE_FIELDS`), ``Sie-Items`` (a JSON array of each item's ``[index,
cost]``). A result message is a msgpack array of encoded :class:`protocol.work.WorkResult`, to a
request's reply subject or to a gateway's results subject.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from protocol.api import Item
from protocol.codec import CodecError, packb, unpackb, unpackb_plain
from protocol.ipc import DEAD_LETTER, ItemOutcome, RunBatchRequest
from protocol.jobs import JOB_TYPES, Input, Job, JobItem, ScoreInput, work_item_id
from protocol.records import plain, record
from protocol.work import WorkResult

MSG_ID = "Nats-Msg-Id"
H_ROUTE = "Sie-Route"
H_ITEMS = "Sie-Items"
H_PAYLOAD = "Sie-Payload"  # the message's body is the payload store's object of this name
# On a message the gateway sends on the direct path: the subject the sidecar that takes it answers
# on (protocol.subjects.taken_subject), before it works on it.
H_TAKEN = "Sie-Taken"
# A gateway that sends a message again after a reconnect (a result may have been lost) must get it
# past the stream's duplicate window: its id then carries ``~<n>``.
REDISPATCH_MARK = "~"
MAX_CHUNK_ITEMS = 1024
_ARRAY_HEAD = 5  # the most a msgpack array or bin header takes


def redispatch_msg_id(msg_id: str, attempt: int) -> str:
    """The ``Nats-Msg-Id`` of a message's ``attempt``-th re-dispatch."""
    return f"{msg_id}{REDISPATCH_MARK}{attempt}"


@dataclass(frozen=True)
class WorkMessage:
    """One work message of a request: the indices of the items it carries, its body and headers,
    and the payload-store object its body went to, if any."""

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


_NUM = (int, float, type(None))
# (field, its JSON types; exact types, so that true and false are not taken for integers)
_ROUTE_FIELDS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("request_id", (str,)),
    ("reply_subject", (str,)),
    ("model_spec", (str,)),  # the worker's model spec: model_id or model_id:profile
    ("operation", (str,)),
    ("group_key", (str,)),  # Job.batch_key: items with equal keys may share a batch
    ("timestamp", _NUM),  # unix seconds the front door built the job (queue wait)
    ("deadline", _NUM),  # unix seconds after which nobody waits for the result
    ("traceparent", (str, type(None))),
    ("request_items", (int,)),  # items of the request published together (the sidecar's gather)
    ("results_subject", (str, type(None))),  # where its result may go with others' (null: alone)
)


@dataclass(frozen=True)
class RoutingHeader:
    """One item of a work message, as the sidecar reads it from the headers (an ItemIds)."""

    work_item_id: str
    item_index: int
    cost: int  # input_cost: the sidecar's batching unit before it learns tokens per unit
    request_id: str
    reply_subject: str
    model_spec: str
    operation: str
    group_key: str
    timestamp: float | None = None
    deadline: float | None = None
    traceparent: str | None = None
    request_items: int = 1
    results_subject: str | None = None


class WorkCodec:
    """Jobs ↔ work messages ↔ RunBatch bodies, and results ↔ result messages (stateless)."""

    # ------------------------------------------------------------------ the gateway: job → messages
    @staticmethod
    def messages(
        items: Sequence[JobItem],
        *,
        per_message: int,
        max_bytes: int,
        request_items: int = 1,
        results_subject: str | None = None,
    ) -> list[WorkMessage]:
        """The work messages of ``items`` (of one job): at most ``per_message`` items each and, where
        more than one, a body within ``max_bytes``; an item over it travels alone (the caller puts a
        body over the NATS max payload in the payload store: :meth:`offloaded`)."""
        job = items[0].job
        shared = encode_job(job)
        owns = [encode_input(it.index, it.input) for it in items]
        route = [
            job.request_id, job.reply_subject, job.model_spec, job.operation, job.batch_key,
            job.timestamp, job.deadline, job.traceparent or None, request_items, results_subject,
        ]  # fmt: skip
        room = max(1, max_bytes - len(shared) - 2 * _ARRAY_HEAD)
        out: list[WorkMessage] = []
        for run in chunk_plan([len(o) for o in owns], max(1, per_message), room):
            first = items[run[0]]
            route[8] = max(request_items, len(run))  # request_items
            headers = {
                MSG_ID: first.work_item_id if len(run) == 1 else f"{first.work_item_id}+{len(run)}",
                H_ROUTE: orjson.dumps(route).decode(),
                H_ITEMS: orjson.dumps([[items[i].index, items[i].cost] for i in run]).decode(),
            }
            body = packb([shared, [owns[i] for i in run]])
            out.append(WorkMessage(tuple(items[i].index for i in run), body, headers))
        return out

    @staticmethod
    def offloaded(message: WorkMessage, name: str) -> WorkMessage:
        """``message`` with its body in the payload store under ``name``: an empty body, a header."""
        return WorkMessage(message.slots, b"", {**message.headers, H_PAYLOAD: name}, name)

    # ------------------------------------------------------------------ the sidecar: message → items
    @staticmethod
    def routes(headers: dict[str, str] | None) -> list[RoutingHeader]:
        """The route of each item a delivered work message carries; ValueError when a header is
        missing or malformed."""
        if not headers or MSG_ID not in headers or H_ROUTE not in headers or H_ITEMS not in headers:
            raise ValueError(f"headers {MSG_ID}, {H_ROUTE}, {H_ITEMS} wanted, got {sorted(headers or ())}")
        shared = _route_fields(headers[H_ROUTE])
        try:
            pairs = orjson.loads(headers[H_ITEMS])
        except orjson.JSONDecodeError:
            raise ValueError(f"{H_ITEMS} is not JSON") from None
        if type(pairs) is not list or not 1 <= len(pairs) <= MAX_CHUNK_ITEMS:
            raise ValueError(f"{H_ITEMS} is not an array of 1 to {MAX_CHUNK_ITEMS} items")
        request_id = shared["request_id"]
        routes: list[RoutingHeader] = []
        seen: set[int] = set()
        for pair in pairs:
            if not (
                type(pair) is list
                and len(pair) == 2
                and type(pair[0]) is int
                and type(pair[1]) is int
                and pair[0] >= 0
                and pair[1] >= 1
            ):
                raise ValueError(f"{H_ITEMS} entry {pair!r} is not [item_index, cost]")
            index, cost = pair
            if index in seen:
                raise ValueError(f"{H_ITEMS} names an item twice")
            seen.add(index)
            route = object.__new__(RoutingHeader)
            object.__setattr__(
                route,
                "__dict__",
                {
                    "work_item_id": work_item_id(request_id, index),
                    "item_index": index,
                    "cost": cost,
                    **shared,
                },
            )
            routes.append(route)
        return routes

    @staticmethod
    def payload_ref(headers: dict[str, str] | None) -> str | None:
        """The payload store's object that holds the message's body, if it names one."""
        return (headers or {}).get(H_PAYLOAD)

    @staticmethod
    def split(body: bytes, count: int) -> tuple[bytes, list[bytes]]:
        """The job and the ``count`` inputs of a work message's body, as bytes (the sidecar hands
        them on undecoded); ValueError when it is not one."""
        try:
            decoded = unpackb_plain(body)
        except CodecError as exc:
            raise ValueError(f"the body is not msgpack: {exc}") from None
        if type(decoded) is not list or len(decoded) != 2:
            raise ValueError("a work message's body must be [job, [input, ...]]")
        shared, owns = decoded
        if (
            type(shared) is not bytes
            or type(owns) is not list
            or len(owns) != count
            or not all(type(b) is bytes for b in owns)
        ):
            raise ValueError(f"a work message's body must carry its job and {count} encoded inputs")
        return shared, owns

    @staticmethod
    def run_batch(
        model_id: str,
        parts: Sequence[tuple[str, bytes, bytes]],
        *,
        worker_id: str,
        priority: str,
    ) -> RunBatchRequest:
        """The RunBatch request of ``parts`` (each item's id, its job's bytes, its input's bytes):
        each job's bytes once (the items of one message share one object)."""
        index: dict[int, int] = {}
        jobs: list[bytes] = []
        item_job: list[int] = []
        for _, shared, _ in parts:
            k = index.get(id(shared))
            if k is None:
                k = index[id(shared)] = len(jobs)
                jobs.append(shared)
            item_job.append(k)
        return RunBatchRequest(
            model_id=model_id,
            worker_id=worker_id,
            priority=priority,
            item_ids=[p[0] for p in parts],
            jobs=jobs,
            items=[p[2] for p in parts],
            item_job=item_job,
        )

    @staticmethod
    def outcomes(body: Any) -> dict[str, list[ItemOutcome]]:
        """RunBatch's answer as the outcomes by work item id (in the worker's order for an id sent
        twice); an entry that is not an outcome is left out (its item gets none: NAKed)."""
        entries = body.get("outcomes") if type(body) is dict else None
        by_id: dict[str, list[ItemOutcome]] = {}
        for entry in entries if type(entries) is list else []:
            try:
                outcome = record(ItemOutcome, entry)
            except ValueError:
                continue
            by_id.setdefault(outcome.work_item_id, []).append(outcome)
        return by_id

    @staticmethod
    def items_of(body: bytes) -> list[JobItem]:
        """The items of a work message's body, read back whole (a dead-lettered message's);
        ValueError when it is not one."""
        try:
            decoded = unpackb_plain(body)
        except CodecError as exc:
            raise ValueError(f"the body is not msgpack: {exc}") from None
        if type(decoded) is not list or len(decoded) != 2 or type(decoded[1]) is not list:
            raise ValueError("a work message's body must be [job, [input, ...]]")
        job = decode_job(decoded[0])
        return [decode_input(job, own) for own in decoded[1]]

    # ------------------------------------------------------------------ the worker: batch → job items
    @staticmethod
    def job_items(request: RunBatchRequest) -> tuple[list[JobItem], list[ItemOutcome]]:
        """The items of a batch: those that decode, and a DEAD_LETTER outcome for each that does not
        (ValueError when the batch itself is malformed)."""
        ids, items, item_job = request.item_ids, request.items, request.item_job
        if not (
            type(ids) is list
            and type(items) is list
            and type(item_job) is list
            and type(request.jobs) is list
        ):
            raise ValueError("item_ids, items, jobs and item_job must be lists")
        if not len(ids) == len(items) == len(item_job) or not all(type(i) is str for i in ids):
            raise ValueError("item_ids, items and item_job must name each item once")
        jobs: list[Job | ValueError] = []
        for raw in request.jobs:
            try:
                jobs.append(decode_job(raw))
            except ValueError as exc:
                jobs.append(ValueError(f"its job does not decode: {exc}"))
        good: list[JobItem] = []
        dead: list[ItemOutcome] = []
        for item_id, raw, k in zip(ids, items, item_job, strict=True):
            try:
                if type(k) is not int or not 0 <= k < len(jobs):
                    raise ValueError(f"item_job entry {k!r} names no job")
                job = jobs[k]
                if isinstance(job, ValueError):
                    raise job
                item = decode_input(job, raw)
                if item.work_item_id != item_id:
                    raise ValueError(f"its id is {item.work_item_id!r}, not {item_id!r}")
                good.append(item)
            except ValueError as exc:
                dead.append(ItemOutcome(item_id, DEAD_LETTER, error=f"undecodable work item: {exc}"))
        return good, dead

    # ------------------------------------------------------------------ results
    @staticmethod
    def results_message(encoded: list[bytes]) -> bytes:
        """A result message of results already encoded (:meth:`WorkResult.to_msgpack`), as they are."""
        return packb(encoded)

    @staticmethod
    def results(data: bytes) -> list[WorkResult]:
        """The results of a result message; ValueError when it is not one."""
        try:
            decoded = unpackb_plain(data)
        except CodecError as exc:
            raise ValueError(f"a results message is not msgpack: {exc}") from None
        if type(decoded) is not list or not all(type(r) is bytes for r in decoded):
            raise ValueError("a results message must be an array of encoded results")
        return [WorkResult.from_msgpack(r) for r in decoded]

    @staticmethod
    def results_chunks(sizes: list[int], max_bytes: int) -> list[list[int]]:
        """Indices of encoded results, in order, cut into runs whose :meth:`results_message` stays
        within ``max_bytes``; a result too big to share a message gets one of its own."""
        return chunk_plan(sizes, max(1, len(sizes)), max_bytes)


def chunk_plan(sizes: list[int], max_items: int, max_bytes: int) -> list[list[int]]:
    """Indices of encoded parts (their ``sizes``), in order, cut into the messages that carry them:
    at most ``max_items`` per message and, where more than one, within ``max_bytes`` together; a
    part over ``max_bytes`` travels alone."""
    plan: list[list[int]] = []
    run: list[int] = []
    used = _ARRAY_HEAD
    for i, size in enumerate(sizes):
        need = size + _ARRAY_HEAD
        if run and (len(run) >= max_items or used + need > max_bytes):
            plan.append(run)
            run, used = [], _ARRAY_HEAD
        run.append(i)
        used += need
    if run:
        plan.append(run)
    return plan


def _route_fields(text: str) -> dict[str, Any]:
    try:
        values = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise ValueError(f"{H_ROUTE} is not JSON") from None
    if type(values) is not list or len(values) != len(_ROUTE_FIELDS):
        raise ValueError(f"{H_ROUTE} is not an array of {len(_ROUTE_FIELDS)} fields")
    for (name, kinds), value in zip(_ROUTE_FIELDS, values, strict=True):
        if type(value) not in kinds:
            raise ValueError(f"{H_ROUTE} field {name} is {value!r}")
    route = dict(zip((name for name, _ in _ROUTE_FIELDS), values, strict=True))
    if not (route["request_id"] and route["reply_subject"] and route["model_spec"]):
        raise ValueError("empty routing header")
    if route["request_items"] < 1:
        raise ValueError(f"{H_ROUTE}: request_items must be positive")
    return route


# ---------------------------------------------------------------------------- jobs and inputs


def encode_job(job: Job) -> bytes:
    """A job without its inputs: its operation and fields (params as a nested map)."""
    return packb({"op": job.operation, **plain(job)})


def decode_job(raw: Any) -> Job:
    """A job from :func:`encode_job`'s bytes; ValueError when they are not one."""
    if type(raw) is not bytes:
        raise ValueError("a job must be encoded")
    try:
        data = unpackb_plain(raw)
    except CodecError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if type(data) is not dict:
        raise ValueError("a job must be a map")
    cls = JOB_TYPES.get(data.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown operation {str(data.get('op'))[:40]!r}")
    job = record(cls, data)
    if not (job.request_id and job.reply_subject and job.model_id and job.batch_key):
        raise ValueError("a job lacks its request_id, reply_subject, model_id or batch_key")
    return job


def item_map(item: Item) -> dict[str, Any]:
    """An input item as a map: its fields that are set, and the unknown keys a client sent."""
    fields_ = {k: v for k, v in item.__dict__.items() if v is not None}
    extra = item.__pydantic_extra__
    return {**extra, **fields_} if extra else fields_


def input_map(value: Input) -> dict[str, Any]:
    """An input as a map: ``{"item": item}``, a score input's ``{"query": item, "items": [...]}``."""
    if isinstance(value, ScoreInput):
        return {"query": item_map(value.query), "items": [item_map(d) for d in value.items]}
    return {"item": item_map(value)}


def encode_input(index: int, value: Input) -> bytes:
    return packb({"i": index, **input_map(value)})


def decode_input(job: Job, raw: Any) -> JobItem:
    """Input ``raw`` of ``job``; ValueError when it is not one of that job's operation."""
    if type(raw) is not bytes:
        raise ValueError("an input must be encoded")
    try:
        data = unpackb(raw)
    except CodecError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if type(data) is not dict or type(data.get("i")) is not int or data["i"] < 0:
        raise ValueError("an input must be a map with its index")
    if job.operation == "score":
        docs = data.get("items")
        if type(docs) is not list:
            raise ValueError("a score input must carry its items")
        value: Input = ScoreInput(_item(data.get("query")), tuple(_item(d) for d in docs))
    else:
        value = _item(data.get("item"))
    return JobItem(job, data["i"], value)


_ITEM_FIELDS = tuple(Item.model_fields)
_ITEM_NAMES = frozenset(_ITEM_FIELDS)
_ITEM_UNSET = dict.fromkeys(_ITEM_FIELDS)
_set = object.__setattr__


def _item(data: Any) -> Item:
    """An Item from its map, its fields' types checked, without running pydantic's validation (the
    front door validated it; this checks that the bytes still say what it sent)."""
    if type(data) is not dict:
        raise ValueError("an item must be a map")
    get = data.get
    if not (
        (get("text") is None or type(data["text"]) is str)
        and (get("id") is None or type(data["id"]) is str)
        and (get("images") is None or type(data["images"]) is list)
        and (get("metadata") is None or type(data["metadata"]) is dict)
    ):
        raise ValueError("an item's text and id must be strings, images a list, metadata a map")
    if _ITEM_NAMES.issuperset(data):  # no key a client added: most items
        values, extra, given = {**_ITEM_UNSET, **data}, {}, set(data)
    else:
        values = {name: get(name) for name in _ITEM_FIELDS}
        extra = {k: v for k, v in data.items() if k not in _ITEM_NAMES and type(k) is str}
        given = {k for k in data if k in _ITEM_NAMES}
    item = Item.__new__(Item)
    _set(item, "__dict__", values)
    _set(item, "__pydantic_extra__", extra)
    _set(item, "__pydantic_fields_set__", given)
    _set(item, "__pydantic_private__", None)
    return item


__all__ = [
    "H_ITEMS",
    "H_PAYLOAD",
    "H_ROUTE",
    "H_TAKEN",
    "MAX_CHUNK_ITEMS",
    "MSG_ID",
    "REDISPATCH_MARK",
    "RoutingHeader",
    "WorkCodec",
    "WorkMessage",
    "chunk_plan",
    "decode_job",
    "encode_job",
    "input_map",
    "item_map",
    "redispatch_msg_id",
]
