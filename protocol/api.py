"""Typed request models of the native inference routes (``POST /v1/encode|score|extract|tokenize``).

What a front door parses is what the worker runs: ``sie serve`` hands the parsed items and params to
its runtime; the gateway puts the items, with the params checked, in a job (protocol.jobs). Responses
are built as dicts by ``gateway/responses.py`` and ``worker/serve/app.py``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import SIEError, invalid_input

OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]
OVERFLOW_POLICIES = ("default", "truncate_text", "error", "chunk")


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
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [{"items": [{"id": "a", "text": "hello"}], "params": {"output_types": ["dense"]}}]
        },
    )

    items: list[Item]
    params: EncodeParams | None = None


class ScoreParams(BaseModel):
    """A score request's parameters (on the wire they sit at the top level of its body)."""

    model_config = ConfigDict(extra="allow")

    instruction: str | None = None
    options: dict[str, Any] | None = None


class ScoreRequest(BaseModel):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [{"query": {"text": "what is ML"}, "items": [{"text": "ML is a field of AI"}]}]
        },
    )

    query: Item
    items: list[Item]
    instruction: str | None = None
    options: dict[str, Any] | None = None

    @property
    def params(self) -> ScoreParams:
        return ScoreParams.model_construct(instruction=self.instruction, options=self.options)


class ExtractParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    labels: list[str] | None = Field(default=None, max_length=1000)
    output_schema: dict[str, Any] | None = None
    instruction: str | None = None
    options: dict[str, Any] | None = None


class ExtractRequest(BaseModel):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={"examples": [{"items": [{"text": "Apple was founded by Steve Jobs."}]}]},
    )

    items: list[Item]
    params: ExtractParams | None = None


class TokenizeParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    options: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """``POST /v1/tokenize/{model}``: the model's own tokenizer over each item's text
    (``params.options.add_special_tokens``, default true; ``profile`` picks a profile)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [{"items": [{"text": "hello"}]}]})

    items: list[Item]
    params: TokenizeParams | None = None


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ItemsResponse(_Answer):
    """The answer of encode, extract and tokenize: one entry per request item, in order."""

    model: str
    items: list[dict[str, Any]]
    timing: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


class ScoreEntry(_Answer):
    item_id: str
    score: float
    rank: int


class ScoreResponse(_Answer):
    """The answer of score: one entry per item, by descending score."""

    model: str
    query_id: str | None = None
    scores: list[ScoreEntry]
    timing: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


class ModelEntry(_Answer):
    name: str
    inputs: list[str]
    outputs: list[str]
    dims: dict[str, Any]
    loaded: bool


class ModelsResponse(_Answer):
    """``GET /v1/models``: SIE clients read ``models``, OpenAI clients ``data``."""

    models: list[ModelEntry]
    object: str
    data: list[dict[str, Any]]


class BatchBody(BaseModel):
    """``POST /v1/batches`` (OpenAI's Batch API): which file, which endpoint each line calls."""

    model_config = ConfigDict(extra="allow")

    input_file_id: str = Field(min_length=1, description="A file uploaded with purpose 'batch'")
    endpoint: Literal["/v1/embeddings", "/v1/encode"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class FileUpload(BaseModel):
    """``POST /v1/files`` (multipart/form-data): a JSONL file of request lines."""

    purpose: Literal["batch"]
    file: bytes = Field(json_schema_extra={"format": "binary"})


class PoolBody(BaseModel):
    """``POST /v1/pools``: the shape (types) of a pool request; names of profiles, bundles and
    models are checked against the cluster after this (gateway/pools.py)."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    gpus: dict[str, Annotated[int, Field(ge=0)]] | None = None
    gpu_caps: dict[str, Annotated[int, Field(ge=0)]] | None = None
    queue_pool: str | None = None
    bundle: str | None = None
    minimum_worker_count: int = Field(default=0, ge=0)
    pinned_models: list[str] | None = None
    priority: str | None = None
    ttl_seconds: float | None = Field(default=None, gt=0)


M = TypeVar("M", bound=BaseModel)


def truncation_totals(entries: list[Any]) -> tuple[int, int]:
    """(items truncated, tokens truncation cut off) over result entries (encode/extract items,
    score entries) that report ``truncated`` with ``input_tokens`` (before) and ``used_tokens``."""
    items = dropped = 0
    for e in entries:
        if isinstance(e, dict) and e.get("truncated"):
            items += 1
            dropped += max(0, int(e.get("input_tokens") or 0) - int(e.get("used_tokens") or 0))
    return items, dropped


def usage(input_tokens: int | None, truncated_items: int, dropped_tokens: int) -> dict[str, int]:
    """A response's ``usage`` map: ``input_tokens`` (when counted), and the truncation totals:
    ``truncated_items`` (items whose input was cut to the model's limit) and ``dropped_tokens``
    (the tokens those cuts removed)."""
    out = {"truncated_items": int(truncated_items), "dropped_tokens": int(dropped_tokens)}
    if input_tokens is not None:
        out = {"input_tokens": int(input_tokens), **out}
    return out


def _field_error(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> SIEError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in (*prefix, *err["loc"]))
    return invalid_input(f"Field '{loc}': {err['msg']}", param=loc)


def parse_request(model: type[M], data: Any) -> M:
    """Validate a decoded body; any schema problem becomes 400 INVALID_INPUT naming the field."""
    if not isinstance(data, dict):
        raise invalid_input("request body must be a map")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc) from None
    items = getattr(parsed, "items", None)
    if isinstance(items, list) and not items:
        raise invalid_input("Field 'items' must not be empty", param="items")
    return parsed


__all__ = [
    "OVERFLOW_POLICIES",
    "EncodeParams",
    "EncodeRequest",
    "ExtractParams",
    "ExtractRequest",
    "Item",
    "ItemsResponse",
    "ModelEntry",
    "ModelsResponse",
    "PoolBody",
    "ScoreEntry",
    "ScoreResponse",
    "ScoreParams",
    "ScoreRequest",
    "TokenizeParams",
    "TokenizeRequest",
    "parse_request",
    "truncation_totals",
    "usage",
]
