"""One frozen job per operation: a request parsed, resolved and validated once, at its front door.

A front door (the gateway; ``sie serve`` checks the same params with :mod:`protocol.params`) turns a
request into a :class:`Job` of its operation, whose ``params`` are the checked options of
:mod:`protocol.params`, and its inputs (:class:`protocol.api.Item`; a score request's one
:class:`ScoreInput`). Each input with its job is a :class:`JobItem`, the unit that is cached,
published, batched and run. The job crosses NATS and the IPC as that type through
:class:`protocol.work_codec.WorkCodec`; the worker checks only what it alone knows (the model's
limits). A new field of a job is a field here and a line of the codec's tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from protocol.api import Item
from protocol.model_config import model_spec
from protocol.params import EncodeOptions, ExtractOptions, ScoreOptions, TokenizeOptions


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every job carries: its ids, where it runs, where its results go, its deadline."""

    operation: ClassVar[str]

    request_id: str
    model_id: str
    profile_id: str
    pool_name: str
    machine_profile: str
    router_id: str
    reply_subject: str  # the gateway's inbox of this request
    timestamp: float  # unix seconds the front door built it (queue wait)
    total_items: int
    deadline: float | None = None  # unix seconds after which nobody waits for its results
    bundle: str | None = None
    bundle_config_hash: str | None = None
    traceparent: str | None = None  # W3C trace context of the request (protocol.tracing)
    tracestate: str | None = None
    # jobs of equal keys run in one forward pass with the same parameters: a digest of the
    # operation, model, profile and params, derived when the job is built (see __post_init__)
    batch_key: str = ""

    def __post_init__(self) -> None:
        if not self.batch_key:
            content = repr((self.operation, self.model_id, self.profile_id, self.content()))
            key = hashlib.blake2b(content.encode(), digest_size=12).hexdigest()
            object.__setattr__(self, "batch_key", key)

    def content(self) -> object:
        """What decides how its inputs run, beside operation and model: its params."""
        raise NotImplementedError

    @property
    def model_spec(self) -> str:
        """The worker's model spec: ``model_id``, or ``model_id:profile``."""
        return model_spec(self.model_id, self.profile_id)

    @property
    def lora(self) -> str | None:
        return getattr(self.content(), "lora", None)


@dataclass(frozen=True, kw_only=True)
class EncodeJob(Job):
    operation: ClassVar[str] = "encode"
    params: EncodeOptions

    def content(self) -> EncodeOptions:
        return self.params


@dataclass(frozen=True, kw_only=True)
class ScoreJob(Job):
    operation: ClassVar[str] = "score"
    params: ScoreOptions

    def content(self) -> ScoreOptions:
        return self.params


@dataclass(frozen=True, kw_only=True)
class ExtractJob(Job):
    operation: ClassVar[str] = "extract"
    params: ExtractOptions

    def content(self) -> ExtractOptions:
        return self.params


@dataclass(frozen=True, kw_only=True)
class TokenizeJob(Job):
    operation: ClassVar[str] = "tokenize"
    params: TokenizeOptions

    def content(self) -> TokenizeOptions:
        return self.params


JOB_TYPES: dict[str, type[Job]] = {
    cls.operation: cls for cls in (EncodeJob, ScoreJob, ExtractJob, TokenizeJob)
}
OPERATIONS = tuple(JOB_TYPES)


@dataclass(frozen=True)
class ScoreInput:
    """The one input of a score job: the query and the items scored against it."""

    query: Item
    items: tuple[Item, ...]


Input = Item | ScoreInput


class ItemIds(Protocol):
    """What names one item of a request: a :class:`JobItem`, a routing header, an :class:`ItemRef`."""

    @property
    def work_item_id(self) -> str: ...

    @property
    def request_id(self) -> str: ...

    @property
    def item_index(self) -> int: ...


@dataclass(frozen=True)
class ItemRef:
    """The ids of an item whose job is not at hand (the gateway failing it on a dead letter)."""

    work_item_id: str
    request_id: str
    item_index: int


def work_item_id(request_id: str, index: int) -> str:
    """The id of item ``index`` of request ``request_id``."""
    return f"{request_id}.{index}"


@dataclass(frozen=True, slots=True)
class JobItem:
    """Input ``index`` of ``job``: what is cached, published, batched and run (an :class:`ItemIds`)."""

    job: Job
    index: int
    input: Input

    @property
    def work_item_id(self) -> str:
        return f"{self.job.request_id}.{self.index}"

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def item_index(self) -> int:
        return self.index

    @property
    def item(self) -> Item:
        """The input of an encode, extract or tokenize job (TypeError for a score job's)."""
        if not isinstance(self.input, Item):
            raise TypeError(f"a {self.job.operation} job's input is not an item")
        return self.input

    @property
    def cost(self) -> int:
        return input_cost(self.input)


def job_items(job: Job, inputs: Sequence[Input]) -> list[JobItem]:
    """The items of ``job``: one per input, the i-th with index i."""
    return [JobItem(job, i, value) for i, value in enumerate(inputs)]


def text_cost(text: str | None) -> int:
    """Token-count proxy (nobody before the worker tokenizes): chars / 4 + 2; each model's scheduler
    in the sidecar scales it by the tokens per unit it has learned from the worker's counts."""
    return len(text or "") // 4 + 2


def _item_cost(item: Item) -> int:
    text = item.text
    cost = text_cost(text) if text is not None else 0
    for media in (item.images, item.audio, item.video, item.document):
        if media:
            cost += len(media) if isinstance(media, list) else 1
    return max(cost, 1)


def input_cost(value: Input) -> int:
    """Cost estimate of one input: the text proxy, one per medium; a score input's summed over its
    (query, item) pairs."""
    if isinstance(value, ScoreInput):
        q = _item_cost(value.query)
        return max(1, sum(q + _item_cost(d) for d in value.items)) if value.items else q
    return _item_cost(value)


__all__ = [
    "JOB_TYPES",
    "OPERATIONS",
    "EncodeJob",
    "ExtractJob",
    "Input",
    "ItemIds",
    "ItemRef",
    "Job",
    "JobItem",
    "ScoreInput",
    "ScoreJob",
    "TokenizeJob",
    "input_cost",
    "job_items",
    "text_cost",
    "work_item_id",
]
