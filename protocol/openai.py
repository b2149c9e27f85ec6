"""The OpenAI-compatible ``POST /v1/embeddings`` request and response, for every front door.

Request (unknown fields ignored): ``model`` (string), ``input`` (a string or an array of strings;
token-id arrays are refused), ``encoding_format`` (``float`` or ``base64``: little-endian float32
bytes), ``dimensions`` (Matryoshka: the first N components, re-normalised; 1 ≤ N ≤ the model's
native dense dimension). Response:
``{object: "list", data: [{object: "embedding", embedding, index}], model, usage}``; usage counts
the worker's tokens, or estimates ``max(1, characters // 4)`` when it has none.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.catalog import Resolved, model_dims, supported_outputs
from protocol.errors import ErrorCode, SIEError, invalid_input

EncodingFormat = Literal["float", "base64"]
T = TypeVar("T")


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    inputs: list[str]
    encoding_format: EncodingFormat
    dimensions: Any = None  # as sent; see check_dimensions


class EmbeddingsBody(BaseModel):
    """The wire body of ``POST /v1/embeddings`` (unknown fields ignored)."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"examples": [{"model": "sie-fake", "input": ["hello"]}]}
    )

    model: str = Field(min_length=1)
    input: str | list[str] = Field(min_length=1)
    encoding_format: EncodingFormat | None = None
    dimensions: Any = Field(default=None, json_schema_extra={"type": ["integer", "null"], "minimum": 1})
    user: Any = None


class EmbeddingRow(BaseModel):
    object: str
    embedding: list[float] | str
    index: int


class EmbeddingsResponse(BaseModel):
    object: str
    data: list[EmbeddingRow]
    model: str
    usage: dict[str, Any]


def parse_embeddings_request(data: Any, *, max_inputs: int) -> EmbeddingsRequest:
    """Validate a decoded body; raises INVALID_INPUT (with ``param``) on the first problem: the
    contract's own messages first, then :class:`EmbeddingsBody` (what ``/openapi.json`` shows)."""
    if not isinstance(data, dict):
        raise invalid_input("Request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_input("'model' is required", param="model")
    inputs = data.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list):
        raise invalid_input("'input' must be a string or an array of strings", param="input")
    if not inputs:
        raise invalid_input("Input cannot be empty", param="input")
    if not all(isinstance(x, str) for x in inputs):
        raise invalid_input("token-array embeddings input is not supported", param="input")
    if len(inputs) > max_inputs:
        raise invalid_input(f"At most {max_inputs} inputs per request", param="input")
    fmt: EncodingFormat
    requested = data.get("encoding_format") or "float"
    if requested == "float":
        fmt = "float"
    elif requested == "base64":
        fmt = "base64"
    else:
        raise invalid_input("encoding_format must be 'float' or 'base64'", param="encoding_format")
    try:
        body = EmbeddingsBody.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise invalid_input(f"Field '{param}': {err['msg']}", param=param) from None
    return EmbeddingsRequest(body.model, inputs, fmt, body.dimensions)


def dimension_options(requested: Any, native: int | None) -> dict[str, Any]:
    """Encode options for ``dimensions``: none when absent or native, ``output_dim`` (Matryoshka
    truncation) below it; INVALID_INPUT for anything else."""
    if requested is None or requested == native:
        return {}
    if (
        not isinstance(requested, int)
        or isinstance(requested, bool)
        or native is None
        or not 0 < requested < native
    ):
        raise invalid_input(
            f"dimensions must be an integer from 1 to the model's dimension {native}, got {requested!r}",
            param="dimensions",
            openai_code="unsupported_field",
        )
    return {"output_dim": requested}


def models_response(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``GET /v1/models`` for both kinds of client: SIE clients read ``models``, OpenAI clients
    ``object``/``data``."""
    return {
        "models": entries,
        "object": "list",
        "data": [{"id": e["name"], "object": "model", "created": 0, "owned_by": "sie"} for e in entries],
    }


def embedding_row(values: Any, index: int, encoding_format: EncodingFormat) -> dict[str, Any]:
    """One ``data`` entry: the dense vector as floats, or as base64 of little-endian float32."""
    vector = np.asarray(values, dtype=np.float32).reshape(-1)
    embedding: Any
    if encoding_format == "base64":
        embedding = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    else:
        embedding = vector.tolist()
    return {"object": "embedding", "embedding": embedding, "index": index}


def embeddings_response(
    model: str, rows: list[dict[str, Any]], inputs: Sequence[str], input_tokens: int | None
) -> dict[str, Any]:
    """The response body; ``input_tokens=None`` means the worker counted none (estimate from text)."""
    if input_tokens is None:
        tokens, source = max(1, sum(len(s) for s in inputs) // 4), "character_estimate"
    else:
        tokens, source = int(input_tokens), "worker"
    return {
        "object": "list",
        "data": rows,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "sie_token_source": source},
    }


def dense_dimension(resolved: Resolved, model: str) -> int | None:
    """The native dense dimension of the model a request resolved to; INVALID_INPUT when the
    profile produces no dense output (the route serves dense embeddings only)."""
    if "dense" not in supported_outputs(resolved):
        raise invalid_input(f"Model '{model}' does not produce dense embeddings", param="model")
    return model_dims(resolved.config).get("dense")


def resolve_model(resolve: Callable[[str], T], model: str) -> T:
    """``resolve(model)``, with an unknown model reported against ``param: "model"``."""
    try:
        return resolve(model)
    except SIEError as err:
        if err.code == ErrorCode.MODEL_NOT_FOUND:
            raise SIEError(ErrorCode.MODEL_NOT_FOUND, err.message, param="model") from None
        raise
