"""The shapes the SDK sends and returns, one ``TypedDict`` per concept.

Results stay plain dicts at run time (the public ``sie-sdk`` returns dicts, and code written for it
indexes them); these types name their keys for type checkers. ``Options`` and an extraction's
``output_schema``/``data`` are free-form by design: each model reads its own keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

Options: TypeAlias = Mapping[str, Any]
"""Per-call model options (``profile``, ``lora_id``, ``is_query``, ``add_special_tokens``...)."""

Vector: TypeAlias = npt.NDArray[np.generic]


class Usage(TypedDict, total=False):
    """Units the call was billed for (``X-SIE-Units-*``) and the truncation totals of its body."""

    input_tokens: int
    pairs: int
    content_input_tokens: int
    images: int
    pages: int
    output_tokens: int
    audio_ms: int
    truncated_items: int
    dropped_tokens: int


class RequestMeta(TypedDict, total=False):
    """What the answer's headers said about the request; ``result["request"]`` and ``error.request``."""

    id: str
    usage: Usage
    served_by: str
    runtime_instance_id: str
    upstream: str
    fallback_reason: str


class Truncation(TypedDict, total=False):
    truncated: bool
    input_tokens: int | None
    used_tokens: int | None


class SparseVector(TypedDict):
    indices: Vector
    values: Vector


class Chunk(TypedDict):
    start: int
    end: int
    dense: Vector


class EncodeResult(Truncation, total=False):
    model: str
    id: str
    dense: Vector
    sparse: SparseVector
    multivector: Vector
    chunks: list[Chunk]
    timing: dict[str, float]
    request: RequestMeta


class ScoreEntry(Truncation):
    item_id: str
    score: float
    rank: int
    span: NotRequired[list[int]]
    chunks: NotRequired[list[object]]


class ScoreResult(TypedDict):
    model: str
    scores: list[ScoreEntry]
    query_id: NotRequired[str]
    usage: NotRequired[Usage]
    request: NotRequired[RequestMeta]


class Entity(TypedDict):
    text: str
    label: str
    score: float
    start: NotRequired[int]
    end: NotRequired[int]
    bbox: NotRequired[list[float] | None]


class Relation(TypedDict):
    head: str
    tail: str
    relation: str
    score: float


class Classification(TypedDict):
    label: str
    score: float


class DetectedObject(TypedDict):
    label: str
    score: float
    bbox: list[float]


class ItemError(TypedDict):
    code: str
    message: str


class ExtractResult(Truncation, total=False):
    model: str
    id: str
    entities: list[Entity]
    relations: list[Relation]
    classifications: list[Classification]
    objects: list[DetectedObject]
    data: dict[str, Any]  # what the model filled in of the caller's output_schema
    error: ItemError
    request: RequestMeta


class TokenizeResult(TypedDict):
    model: str
    tokens: list[str]
    ids: list[int]
    offsets: list[tuple[int, int]]
    count: int
    id: NotRequired[str]
    request: NotRequired[RequestMeta]


class ModelInfo(TypedDict):
    """An entry of ``GET /v1/models`` (``protocol.api.ModelEntry``); servers may add keys."""

    name: str
    inputs: list[str]
    outputs: list[str]
    dims: dict[str, int]
    loaded: bool


class WorkerInfo(TypedDict):
    name: str
    url: str
    gpu: str
    gpu_count: int
    ready_gpu_slots: int
    healthy: bool
    queue_depth: int
    pending_cost: float
    inflight_batches: int
    loaded_models: list[str]
    memory_used_bytes: int
    memory_total_bytes: int
    bundle: str
    bundle_config_hash: str


class Capacity(TypedDict):
    status: str
    worker_count: int
    gpu_count: int
    models_loaded: int
    configured_gpu_types: list[str]
    live_gpu_types: list[str]
    workers: list[WorkerInfo]


class PoolSpec(TypedDict, total=False):
    """``POST /v1/pools`` (``protocol.api.PoolBody``), and the spec the gateway echoes back."""

    name: str
    gpus: dict[str, int]
    gpu_caps: dict[str, int]
    queue_pool: str
    bundle: str | None
    minimum_worker_count: int
    pinned_models: list[str]
    ttl_seconds: float | None


class AssignedWorker(TypedDict):
    name: str
    url: str
    gpu: str
    bundle: str


class PoolStatus(TypedDict, total=False):
    state: str
    assigned_workers: list[AssignedWorker]
    created_at: float
    last_renewed: float


class PoolInfo(TypedDict):
    name: str
    spec: PoolSpec
    status: PoolStatus
