"""Work item, work result and heartbeat schemas.

On the wire each is a msgpack map (heartbeats: JSON) with named keys; unknown keys are ignored and
missing optional keys take their defaults, so either side can add fields without breaking the other.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Protocol, TypeVar

import orjson

from protocol.codec import packb, unpackb
from protocol.model_config import model_spec

OPERATIONS = ("encode", "score", "extract", "tokenize")

T = TypeVar("T")


def _from_map(cls: type[T], data: dict[str, Any]) -> T:
    names = _names(cls)
    if names.issuperset(data):  # what our own producers send: no unknown key to drop
        return cls(**data)
    return cls(**{k: v for k, v in data.items() if k in names})


_NAMES: dict[type, frozenset[str]] = {}


def _names(cls: type) -> frozenset[str]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = frozenset(f.name for f in fields(cls))
    return names


def _set_fields(obj: Any) -> dict[str, Any]:
    """The fields of dataclass ``obj`` (one without slots, whose ``__dict__`` holds exactly its
    fields) that are not None, shallow (``asdict`` deep-copies every nested map and list, which
    costs more than encoding them)."""
    return {k: v for k, v in obj.__dict__.items() if v is not None}


class ItemIds(Protocol):
    """What names one item of a request: a :class:`WorkItem`, or an :class:`ItemRef`."""

    @property
    def work_item_id(self) -> str: ...

    @property
    def request_id(self) -> str: ...

    @property
    def item_index(self) -> int: ...


@dataclass(frozen=True)
class ItemRef:
    """The ids of an item whose WorkItem is not at hand (the gateway failing it on a dead letter)."""

    work_item_id: str
    request_id: str
    item_index: int


@dataclass
class WorkItem:
    work_item_id: str
    request_id: str
    item_index: int
    total_items: int
    operation: str
    model_id: str
    profile_id: str
    pool_name: str
    machine_profile: str
    router_id: str
    reply_subject: str
    timestamp: float
    bundle_config_hash: str | None = None
    item: dict[str, Any] | None = None
    payload_ref: str | None = None
    output_types: list[str] | None = None
    output_dtype: str | None = None
    instruction: str | None = None
    is_query: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    query_item: dict[str, Any] | None = None
    query_payload_ref: str | None = None
    score_items: list[dict[str, Any]] | None = None
    labels: list[str] | None = None
    output_schema: dict[str, Any] | None = None
    deadline: float | None = None
    bundle: str | None = None
    # Items with equal keys run in one forward pass with the same parameters (see group_key);
    # the gateway stamps it once per request, so neither the sidecar nor the worker derives it.
    batch_key: str | None = None
    traceparent: str | None = None  # W3C trace context of the request (protocol.tracing)
    tracestate: str | None = None

    def to_msgpack(self) -> bytes:
        return packb(_set_fields(self))

    def per_item(self, items: list[dict[str, Any] | None]) -> list[WorkItem]:
        """A copy of this item for each of ``items``: the i-th with index i, its id, and ``items[i]``
        as its ``item``; every other field shared (the items of one request; a copy of the fields per
        item, not a run of ``__init__``)."""
        out: list[WorkItem] = []
        for i, item in enumerate(items):
            copy = object.__new__(WorkItem)
            copy.__dict__ = {
                **self.__dict__,
                "work_item_id": work_item_id(self.request_id, i),
                "item_index": i,
                "item": item,
            }
            out.append(copy)
        return out

    @classmethod
    def from_msgpack(cls, data: bytes) -> WorkItem:
        decoded = unpackb(data)
        if not isinstance(decoded, dict):
            raise ValueError("work item must be a map")
        return _from_map(cls, decoded)

    @property
    def model_spec(self) -> str:
        """The worker's model spec of this item: ``model_id``, or ``model_id:profile``."""
        return model_spec(self.model_id, self.profile_id)

    @property
    def lora(self) -> str | None:
        value = self.options.get("lora") or self.options.get("lora_id")
        return str(value) if value else None

    @property
    def group_key(self) -> str:
        """The key of the items that may share a batch: the stamped ``batch_key``, else derived
        (a producer that did not stamp one)."""
        return self.batch_key or batch_key(
            self.operation,
            self.model_id,
            self.profile_id,
            self.output_types,
            self.output_dtype,
            self.instruction,
            self.is_query,
            self.options,
            self.labels,
            self.output_schema,
        )


def batch_key(*params: Any) -> str:
    """A short digest of everything that decides how an item runs: operation, model and profile,
    output types and dtype, instruction, query flag, options (LoRA among them), labels, schema.
    Items of one request share it; equal parameters in another request give the same key (maps
    compare in their key order, so a reordered map only costs a shared batch, never a wrong one)."""
    return hashlib.blake2b(packb(list(params)), digest_size=12).hexdigest()


def text_cost(text: str | None) -> int:
    """Token-count proxy (nobody before the worker tokenizes): chars / 4 + 2; each model's scheduler
    in the sidecar scales it by the tokens per unit it has learned from the worker's counts."""
    return len(text or "") // 4 + 2


_MEDIA_KEYS = ("images", "image", "audio", "video", "document")


def item_cost(
    operation: str,
    item: dict[str, Any] | None,
    query_item: dict[str, Any] | None = None,
    score_items: list[dict[str, Any]] | None = None,
) -> int:
    """Cost estimate of one work item: text proxy; media count 1 each (score: summed over the pairs)."""

    def one(value: dict[str, Any] | None) -> int:
        if not isinstance(value, dict):
            return 1
        text = value.get("text")
        cost = text_cost(text) if isinstance(text, str) else 0
        if len(value) > 1 or text is None:  # a text alone (most items) has no media to look for
            for key in _MEDIA_KEYS:
                media = value.get(key)
                if media:
                    cost += len(media) if isinstance(media, list) else 1
        return max(cost, 1)

    if operation == "score":
        q = one(query_item)
        docs = score_items or []
        return max(1, sum(q + one(d) for d in docs)) if docs else q
    return one(item)


# The headers of a work message: what the sidecar routes, batches, cancels and settles it by, so it
# never decodes the msgpack body (the worker does, once). ``Nats-Msg-Id`` makes a publish sent again
# after a reconnect land in the stream once; everything else rides in one header, ``Sie-Route``, a
# JSON array (fields in ``_ROUTE_FIELDS`` order, ``null`` where unset). One header and not one per
# field: nats-py builds and parses headers in Python, line by line and key by key, on the
# gateway's publish and the sidecar's every delivery.
MSG_ID = "Nats-Msg-Id"
H_ROUTE = "Sie-Route"
# A gateway that sends an item again after a reconnect (its result may have been lost) must get it
# past the stream's duplicate window, so the message id then carries ``~<n>`` after the work item id;
# the work item id is what comes before it (work item ids never contain ``~``).
REDISPATCH_MARK = "~"


def redispatch_msg_id(work_item_id: str, attempt: int) -> str:
    """The ``Nats-Msg-Id`` of an item's ``attempt``-th re-dispatch."""
    return f"{work_item_id}{REDISPATCH_MARK}{attempt}"


def work_item_id(request_id: str, index: int) -> str:
    """The id of item ``index`` of request ``request_id``."""
    return f"{request_id}.{index}"


# A work message may carry several items of one request (a chunk; the gateway's
# SIE_GATEWAY_WORK_CHUNK_ITEMS): one publish, ack, delivery and settlement for all of them instead of
# one each. Its body is then a msgpack array of the items' own encodings, and ``Sie-Items`` lists, in
# the same order, each item's ``[item_index, cost]`` (a JSON array); ``Sie-Route`` is the first item's
# route, which every item of a request shares but for its index and cost. A message without
# ``Sie-Items`` carries one item, its encoding as the body. An item too large to share a message
# travels alone (through the payload store when it is over the NATS max payload).
#
# A chunk's body takes one of two forms. The whole form, a msgpack array of the items' own
# encodings, is what every sidecar reads. The shared form, ``{"shared": <bytes>, "items": [<bytes>,
# ...]}``, carries the fields the request's items share (most of an item's bytes: its ids, inboxes,
# model, parameters, timestamps, trace context) once, as ``shared``, and each item's own fields
# (:data:`OWN_FIELDS`) as its entry; the sidecar hands both to the worker, which merges them. The
# gateway sends it only to a lane whose every worker says it reads it (``Heartbeat.shared_chunks``).
H_ITEMS = "Sie-Items"
# On a message the gateway sends on the direct path: the subject the sidecar that takes it answers
# on (protocol.subjects.taken_subject), before it works on it.
H_TAKEN = "Sie-Taken"
MAX_CHUNK_ITEMS = 1024


# The fields of a work item that differ from item to item of one request (its ``work_item_id``
# follows from ``request_id`` and ``item_index``, so no encoding carries it in the shared form).
OWN_FIELDS = ("item_index", "item", "payload_ref", "query_item", "query_payload_ref", "score_items")
_NOT_SHARED = frozenset({"work_item_id", *OWN_FIELDS})


def encode_shared(item: WorkItem) -> bytes:
    """What ``item`` shares with the other items of its request, encoded once for a chunk."""
    return packb({k: v for k, v in item.__dict__.items() if v is not None and k not in _NOT_SHARED})


def encode_own(item: WorkItem) -> bytes:
    """``item``'s own fields (:data:`OWN_FIELDS`), its entry in a chunk of the shared form."""
    fields_ = item.__dict__
    return packb({k: fields_[k] for k in OWN_FIELDS if fields_[k] is not None})


def pack_items(encoded: list[bytes], shared: bytes | None = None) -> bytes:
    """The body of a chunk: the items' encodings as they are (nobody re-encodes one); with
    ``shared``, the shared form (``encoded`` then holds each item's :func:`encode_own`)."""
    if shared is None:
        return packb(encoded)
    return packb({"shared": shared, "items": encoded})


def unpack_items(data: bytes, count: int) -> tuple[bytes | None, list[bytes]]:
    """The shared encoding (None in the whole form) and the ``count`` item encodings of a chunk's
    body; ValueError when it is not one."""
    decoded = unpackb(data)
    shared = None
    if isinstance(decoded, dict):
        shared, decoded = decoded.get("shared"), decoded.get("items")
        if not isinstance(shared, bytes):
            raise ValueError("a chunk's shared fields must be an encoded map")
    if (
        not isinstance(decoded, list)
        or len(decoded) != count
        or not all(isinstance(b, bytes) for b in decoded)
    ):
        raise ValueError(f"a chunk's body must carry an array of {count} encoded items")
    return shared, decoded


def shared_fields(shared: bytes) -> dict[str, Any]:
    """A chunk's shared fields as the template of its items: every field of a work item, its
    default where the chunk does not share it (:func:`merged_item` fills in each item's own);
    ValueError when they are not a map or lack a field every item needs."""
    decoded = unpackb(shared)
    if not isinstance(decoded, dict):
        raise ValueError("a chunk's shared fields must be a map")
    template = {**_item_defaults(), **{k: v for k, v in decoded.items() if k in _SHARED_NAMES}}
    missing = [name for name, value in template.items() if value is _REQUIRED]
    if missing:
        raise ValueError(f"a chunk's shared fields lack {', '.join(missing)}")
    if not isinstance(template["request_id"], str):
        raise ValueError("a chunk's request_id must be a string")
    return template


_REQUIRED = object()
_SHARED_NAMES = frozenset(f.name for f in fields(WorkItem)) - _NOT_SHARED
_OWN_NAMES = frozenset(OWN_FIELDS)


def _field_defaults() -> tuple[dict[str, Any], list[tuple[str, Callable[[], Any]]]]:
    """Each field of a work item as a template starts it (its default, _REQUIRED where it has none,
    None for an item's own fields), and the fields whose default is a factory: built once."""
    defaults: dict[str, Any] = {}
    factories: list[tuple[str, Callable[[], Any]]] = []
    for f in fields(WorkItem):
        if f.name in _NOT_SHARED:
            defaults[f.name] = None
        elif f.default is not MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not MISSING:
            factories.append((f.name, f.default_factory))
        else:
            defaults[f.name] = _REQUIRED
    return defaults, factories


_ITEM_DEFAULTS, _ITEM_FACTORIES = _field_defaults()


def _item_defaults() -> dict[str, Any]:
    """Each field of a work item as a template starts it, with a fresh value of each factory."""
    return {**_ITEM_DEFAULTS, **{name: factory() for name, factory in _ITEM_FACTORIES}}


def merged_item(template: dict[str, Any], own: bytes) -> WorkItem:
    """The work item of one entry of a chunk of the shared form: ``template`` (the chunk's
    :func:`shared_fields`) with the entry's own fields; ValueError when they do not make one. Its
    items share the template's values (a request's: nobody changes them)."""
    decoded = unpackb(own)
    if not isinstance(decoded, dict):
        raise ValueError("an item's own fields must be a map")
    if not _OWN_NAMES.issuperset(decoded):
        decoded = {k: v for k, v in decoded.items() if k in _OWN_NAMES}
    index = decoded.get("item_index")
    if type(index) is not int:
        raise ValueError("an item lacks its item_index")
    values = {**template, **decoded}
    values["work_item_id"] = work_item_id(values["request_id"], index)
    item = object.__new__(WorkItem)
    item.__dict__ = values
    return item


def work_items_of(data: bytes) -> list[WorkItem]:
    """The work items of a work message's body, a chunk's (either form) or a single item's."""
    decoded = unpackb(data)
    if isinstance(decoded, dict) and "shared" in decoded:
        shared, own = decoded["shared"], decoded.get("items")
        if not isinstance(shared, bytes) or not isinstance(own, list):
            raise ValueError("a chunk of the shared form must carry its shared fields and its items")
        template = shared_fields(shared)
        return [merged_item(template, b) for b in own if isinstance(b, bytes)]
    if isinstance(decoded, list):
        return [WorkItem.from_msgpack(b) for b in decoded if isinstance(b, bytes)]
    if isinstance(decoded, dict):
        return [_from_map(WorkItem, decoded)]
    raise ValueError("a work message's body must be an item or an array of items")


def chunk_plan(sizes: list[int], max_items: int, max_bytes: int) -> list[list[int]]:
    """Indices of a request's encoded items (their ``sizes``), in order, cut into the messages that
    carry them: at most ``max_items`` per message and, where more than one, their bodies within
    ``max_bytes`` together; an item over ``max_bytes`` travels alone."""
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


_NUM = (int, float, type(None))
# (field, its JSON types; exact types, so that true and false are not taken for integers)
_ROUTE_FIELDS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("request_id", (str,)),
    ("item_index", (int,)),
    ("reply_subject", (str,)),
    ("model_spec", (str,)),  # the worker's model spec: model_id or model_id:profile
    ("operation", (str,)),
    ("group_key", (str,)),  # WorkItem.group_key: items with equal keys may share a batch
    ("cost", (int,)),  # item_cost: the sidecar's batching unit before it learns tokens per unit
    ("timestamp", _NUM),  # unix seconds the gateway built the item (queue wait)
    ("deadline", _NUM),  # unix seconds after which nobody waits for the result
    ("traceparent", (str, type(None))),
    ("request_items", (int,)),  # items of the request published with this one (one group key)
    ("results_subject", (str, type(None))),  # where its result may go together with others' (null: alone)
)


@dataclass(frozen=True)
class RoutingHeader:
    """A work message's routing header, as the sidecar reads it (an :class:`ItemIds`)."""

    work_item_id: str
    request_id: str
    item_index: int
    reply_subject: str
    model_spec: str
    operation: str
    group_key: str
    cost: int
    timestamp: float | None = None
    deadline: float | None = None
    traceparent: str | None = None
    # items of the request published together (cache hits are not): the sidecar keeps them in one
    # batch when it can (BatchLimits.gather_s)
    request_items: int = 1
    # the gateway's subject for several results in one message (protocol.subjects.results_subject);
    # None: the result goes to reply_subject on its own
    results_subject: str | None = None

    @staticmethod
    def _route_of(item: WorkItem, request_items: int, results_subject: str | None) -> list[Any]:
        """The ``Sie-Route`` array of ``item`` (``_ROUTE_FIELDS`` order)."""
        return [
            item.request_id, item.item_index, item.reply_subject, item.model_spec, item.operation, item.group_key,
            item_cost(item.operation, item.item, item.query_item, item.score_items), item.timestamp, item.deadline,
            item.traceparent or None, request_items, results_subject,
        ]  # fmt: skip

    @classmethod
    def of(cls, item: WorkItem, request_items: int = 1, results_subject: str | None = None) -> RoutingHeader:
        return cls(item.work_item_id, *cls._route_of(item, request_items, results_subject))

    @classmethod
    def headers_of(
        cls, item: WorkItem, request_items: int = 1, results_subject: str | None = None
    ) -> dict[str, str]:
        """``of(...).headers()`` without building the header object: the gateway's per-item path."""
        route = cls._route_of(item, request_items, results_subject)
        return {MSG_ID: item.work_item_id, H_ROUTE: orjson.dumps(route).decode()}

    @classmethod
    def chunk_headers(
        cls, items: list[WorkItem], request_items: int = 1, results_subject: str | None = None
    ) -> dict[str, str]:
        """The headers of one message carrying ``items`` (of one request, two or more)."""
        first = items[0]
        route = cls._route_of(first, request_items, results_subject)
        costs = [
            [it.item_index, item_cost(it.operation, it.item, it.query_item, it.score_items)] for it in items
        ]
        return {
            MSG_ID: f"{first.work_item_id}+{len(items)}",
            H_ROUTE: orjson.dumps(route).decode(),
            H_ITEMS: orjson.dumps(costs).decode(),
        }

    @classmethod
    def items_of(cls, headers: dict[str, str] | None) -> list[RoutingHeader]:
        """The route of each item a delivered work message carries (one, or a chunk's);
        ValueError when a header is missing or malformed."""
        route = cls.from_headers(headers)
        spec = headers.get(H_ITEMS) if headers else None
        if spec is None:
            return [route]
        try:
            pairs = orjson.loads(spec)
        except orjson.JSONDecodeError:
            raise ValueError(f"{H_ITEMS} is not JSON") from None
        if not isinstance(pairs, list) or not 1 <= len(pairs) <= MAX_CHUNK_ITEMS:
            raise ValueError(f"{H_ITEMS} is not an array of 1 to {MAX_CHUNK_ITEMS} items")
        routes: list[RoutingHeader] = []
        for pair in pairs:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and type(pair[0]) is int
                and type(pair[1]) is int
                and pair[0] >= 0
                and pair[1] >= 1
            ):
                raise ValueError(f"{H_ITEMS} entry {pair!r} is not [item_index, cost]")
            index, cost = pair
            routes.append(route._item(index, cost))
        if len({r.item_index for r in routes}) != len(routes):
            raise ValueError(f"{H_ITEMS} names an item twice")
        return routes

    def _item(self, index: int, cost: int) -> RoutingHeader:
        """This route for item ``index`` of the same request, of ``cost``: a copy of the fields (one
        per item of every chunk delivered; ``dataclasses.replace`` runs the frozen ``__init__``,
        three times slower)."""
        copy = object.__new__(RoutingHeader)
        values = dict(self.__dict__)
        values.update(work_item_id=work_item_id(self.request_id, index), item_index=index, cost=cost)
        object.__setattr__(copy, "__dict__", values)
        return copy

    def headers(self) -> dict[str, str]:
        route = [getattr(self, name) for name, _ in _ROUTE_FIELDS]
        return {MSG_ID: self.work_item_id, H_ROUTE: orjson.dumps(route).decode()}

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> RoutingHeader:
        """The route of a delivered work message; ValueError when a header is missing or malformed."""
        if not headers or MSG_ID not in headers or H_ROUTE not in headers:
            raise ValueError(f"routing headers {MSG_ID} and {H_ROUTE} wanted, got {sorted(headers or ())}")
        try:
            values = orjson.loads(headers[H_ROUTE])
        except orjson.JSONDecodeError:
            raise ValueError(f"{H_ROUTE} is not JSON") from None
        if not isinstance(values, list) or len(values) != len(_ROUTE_FIELDS):
            raise ValueError(f"{H_ROUTE} is not an array of {len(_ROUTE_FIELDS)} fields")
        for (name, types), value in zip(_ROUTE_FIELDS, values, strict=True):
            if type(value) not in types:
                raise ValueError(f"{H_ROUTE} field {name} is {value!r}")
        route = cls(headers[MSG_ID].split(REDISPATCH_MARK, 1)[0], *values)
        if not (route.work_item_id and route.request_id and route.reply_subject and route.model_spec):
            raise ValueError("empty routing header")
        if route.cost < 1 or route.request_items < 1:
            raise ValueError(f"{H_ROUTE}: cost and request_items must be positive")
        return route


@dataclass
class WorkResult:
    work_item_id: str
    request_id: str
    item_index: int
    success: bool
    result_msgpack: bytes | None = None
    error: str | None = None
    error_code: str | None = None
    inference_ms: float = 0.0
    queue_ms: float = 0.0
    processing_ms: float = 0.0
    tokenization_ms: float = 0.0
    postprocessing_ms: float = 0.0
    payload_fetch_ms: float = 0.0
    worker_id: str = ""
    retry_after_s: float | None = None
    input_tokens: int | None = None
    error_extra: dict[str, Any] | None = None
    #: truncation totals of the item (score: of its whole request): items cut, tokens cut off
    truncated_items: int = 0
    dropped_tokens: int = 0
    #: the result's bytes are in the payload store under this name (iokit.payloads): it was
    #: larger than the NATS max payload
    result_ref: str | None = None

    def to_msgpack(self) -> bytes:
        return packb(_set_fields(self))

    @classmethod
    def from_msgpack(cls, data: bytes) -> WorkResult:
        decoded = unpackb(data)
        if not isinstance(decoded, dict):
            raise ValueError("work result must be a map")
        return _from_map(cls, decoded)

    @classmethod
    def failure(
        cls,
        item: ItemIds,
        code: str,
        message: str,
        *,
        retry_after_s: float | None = None,
        extra: dict[str, Any] | None = None,
        worker_id: str = "",
    ) -> WorkResult:
        """The error result of ``item``: every producer of one (worker, sidecar) builds it here."""
        return cls(
            work_item_id=item.work_item_id,
            request_id=item.request_id,
            item_index=item.item_index,
            success=False,
            error=message,
            error_code=str(code),
            retry_after_s=retry_after_s,
            error_extra=dict(extra) if extra else None,
            worker_id=worker_id,
        )


# Several results in one message (to protocol.subjects.results_subject): a msgpack array of the
# results' own encodings, each as the worker made it, so that neither side re-encodes one.
_ARRAY_HEAD = 5  # the most a msgpack array or bin header takes


def pack_results(encoded: list[bytes]) -> bytes:
    return packb(encoded)


def unpack_results(data: bytes) -> list[WorkResult]:
    """The results of a message made by :func:`pack_results`; ValueError when it is not one."""
    decoded = unpackb(data)
    if not isinstance(decoded, list) or not all(isinstance(r, bytes) for r in decoded):
        raise ValueError("a results message must be an array of encoded results")
    return [WorkResult.from_msgpack(r) for r in decoded]


def results_chunks(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Indices of encoded results, in order, cut into runs whose :func:`pack_results` message stays
    within ``max_bytes``; a result too big to share a message gets one of its own."""
    return chunk_plan(sizes, max(1, len(sizes)), max_bytes)


@dataclass
class Heartbeat:
    name: str
    ready: bool
    machine_profile: str
    pool_name: str
    bundle: str
    terminated: bool = False
    gpu_count: int = 1
    total_gpu_slots: int = 1
    ready_gpu_slots: int = 1
    bundle_config_hash: str = ""
    loaded_models: list[str] = field(default_factory=list)
    queue_depth: int = 0
    pending_cost: int = 0
    inflight_batches: int = 0
    saturated: bool = False
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    unsupported_models: list[str] = field(default_factory=list)
    timestamp: float = 0.0
    # routable name (M or M:P) → loaded | loading | failed, for profiles with an instance
    model_states: dict[str, str] = field(default_factory=dict)
    # routable name → the message of its last failed load on this worker
    failed_models: dict[str, str] = field(default_factory=dict)
    # model id → where its weights are for this worker (protocol.weights)
    weights: dict[str, str] = field(default_factory=dict)
    # model ids kept loaded on this worker (SIE_PINNED_MODELS and its pools' pinned_models)
    pinned_models: list[str] = field(default_factory=list)
    # the sidecar and its worker read chunks of the shared form (see ``H_ITEMS``)
    shared_chunks: bool = False

    def to_json(self) -> bytes:
        data = asdict(self)
        for key in ("unsupported_models", "model_states", "failed_models", "weights", "pinned_models"):
            if not data[key]:
                del data[key]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> Heartbeat:
        """Accepts JSON (what we publish) or msgpack."""
        try:
            decoded = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            decoded = unpackb(data)
        if not isinstance(decoded, dict):
            raise ValueError("heartbeat must be a map")
        return _from_map(cls, decoded)
