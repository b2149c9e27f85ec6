"""Typed request and response models of the native inference routes (contract section 3)."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import SIEError, invalid_input

OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]
OVERFLOW_POLICIES = ("default", "truncate_text", "error")


class Item(BaseModel):
    """One input item. Every field is optional and unknown keys are kept (and ignored)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    text: str | None = None
    images: list[Any] | None = None
    audio: Any = None
    video: Any = None
    document: Any = None
    metadata: dict[str, Any] | None = None

    def has_media(self) -> bool:
        return bool(self.images or self.audio or self.video or self.document)


class EncodeParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    output_types: list[str] | None = None
    output_dtype: str | None = None
    instruction: str | None = None
    options: dict[str, Any] | None = None


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    items: list[Item]
    params: EncodeParams | None = None


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    query: Item
    items: list[Item]
    instruction: str | None = None
    options: dict[str, Any] | None = None


class ExtractParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    labels: list[str] | None = Field(default=None, max_length=1000)
    output_schema: dict[str, Any] | None = None
    instruction: str | None = None
    options: dict[str, Any] | None = None


class ExtractRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    items: list[Item]
    params: ExtractParams | None = None


# ---- responses ------------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)


class DenseOut(_Out):
    dims: int
    dtype: str
    values: Any


class SparseOut(_Out):
    dims: int | None = None
    dtype: str
    indices: Any
    values: Any


class MultivectorOut(_Out):
    token_dims: int
    num_tokens: int
    dtype: str
    values: Any


class Timing(_Out):
    total_ms: float = 0.0
    queue_ms: float = 0.0
    tokenization_ms: float = 0.0
    inference_ms: float = 0.0
    postprocessing_ms: float | None = None


class EncodeItemOut(_Out):
    id: str | None = None
    dense: DenseOut | None = None
    sparse: SparseOut | None = None
    multivector: MultivectorOut | None = None


class Usage(_Out):
    input_tokens: int


class EncodeResponse(_Out):
    model: str
    items: list[EncodeItemOut]
    timing: Timing | None = None
    usage: Usage | None = None


class ScoreEntry(_Out):
    item_id: str
    score: float
    rank: int


class ScoreResponse(_Out):
    model: str
    query_id: str | None = None
    scores: list[ScoreEntry]
    timing: Timing | None = None
    usage: Usage | None = None


class Entity(_Out):
    text: str
    label: str
    score: float
    start: int | None = None
    end: int | None = None
    bbox: list[int] | None = None


class Relation(_Out):
    head: str
    tail: str
    relation: str
    score: float


class Classification(_Out):
    label: str
    score: float


class DetectedObject(_Out):
    label: str
    score: float
    bbox: list[int]


class ItemError(_Out):
    code: str
    message: str


class ExtractItemOut(_Out):
    id: str
    entities: list[Entity] = Field(default_factory=list)
    relations: list[Relation] = Field(default_factory=list)
    classifications: list[Classification] = Field(default_factory=list)
    objects: list[DetectedObject] = Field(default_factory=list)
    data: dict[str, Any] = Field(default_factory=dict)
    error: ItemError | None = None


class ExtractResponse(_Out):
    model: str
    items: list[ExtractItemOut]
    timing: Timing | None = None
    usage: Usage | None = None


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], data: Any) -> M:
    """Validate a decoded body; any schema problem becomes 400 INVALID_INPUT naming the field."""
    if not isinstance(data, dict):
        raise invalid_input("request body must be a map")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise invalid_input(f"Field '{loc}': {err['msg']}", param=loc) from None
    items = getattr(parsed, "items", None)
    if isinstance(items, list) and not items:
        raise invalid_input("Field 'items' must not be empty", param="items")
    return parsed


def dump(resp: BaseModel) -> dict[str, Any]:
    """A response model as a plain dict for the codec (None-valued optional keys dropped)."""
    return resp.model_dump(exclude_none=True)


__all__ = [
    "SIEError",
    "DenseOut",
    "EncodeItemOut",
    "EncodeParams",
    "EncodeRequest",
    "EncodeResponse",
    "Entity",
    "ExtractItemOut",
    "ExtractParams",
    "ExtractRequest",
    "ExtractResponse",
    "Item",
    "ItemError",
    "MultivectorOut",
    "OVERFLOW_POLICIES",
    "ScoreEntry",
    "ScoreRequest",
    "ScoreResponse",
    "SparseOut",
    "Timing",
    "Usage",
    "parse_request",
]
