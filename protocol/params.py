"""Validation of request parameters, shared by the worker and the gateway.

The gateway checks a request before publishing it and the worker checks it again before running
it; both use these functions, so a request gets the same 400 INVALID_INPUT from either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.api import OVERFLOW_POLICIES
from protocol.catalog import Resolved, supported_outputs
from protocol.errors import invalid_input
from protocol.model_config import OUTPUT_TYPES

OUTPUT_DTYPES = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
# how an encoder's token states become one vector (worker.adapters.dense.pool)
POOLING_MODES = ("mean", "cls", "max", "last")


def request_options(value: Any) -> dict[str, Any]:
    """A request's ``options`` as a fresh dict (``None`` → ``{}``); anything but a map is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_input("options must be a map", param="options")
    return dict(value)


def merged_options(resolved: Resolved, request: Any) -> dict[str, Any]:
    """Profile runtime options overlaid with the request's options (request wins; ``profile`` dropped)."""
    options = {**resolved.runtime_options, **request_options(request)}
    options.pop("profile", None)
    return options


def instruction(explicit: Any, options: dict[str, Any]) -> str | None:
    """``params.instruction`` → ``options.instruction`` → none; must be a string."""
    value = explicit if explicit is not None else options.get("instruction")
    if value is not None and not isinstance(value, str):
        raise invalid_input("instruction must be a string", param="instruction")
    return value or None


def max_length(options: dict[str, Any], is_query: bool) -> int | None:
    """Token limit of one input: ``query_max_length`` for queries, else ``max_seq_length``; positive ints only."""
    value = options.get("query_max_length") if is_query else None
    value = value or options.get("max_seq_length")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise invalid_input("max_seq_length must be a positive integer", param="max_seq_length")
    return value


def pooling(options: dict[str, Any]) -> str | None:
    """``options.pooling`` (profile or request): one of POOLING_MODES, or unset (the model's own)."""
    value = options.get("pooling")
    if value is not None and value not in POOLING_MODES:
        raise invalid_input(f"pooling must be one of {list(POOLING_MODES)}, got {value!r}", param="pooling")
    return value


def truncates(options: dict[str, Any]) -> bool:
    """Whether over-long inputs are truncated (``overflow_policy`` default/truncate_text/chunk: a chunk
    that still runs over is cut) or refused (error)."""
    policy = options.get("overflow_policy", "default")
    if policy not in OVERFLOW_POLICIES:
        raise invalid_input(
            f"overflow_policy must be one of {list(OVERFLOW_POLICIES)}, got {policy!r}",
            param="overflow_policy",
        )
    return bool(policy != "error")


def output_types(resolved: Resolved, options: dict[str, Any], requested: Any) -> list[str]:
    """Encode outputs: options/profile ``output_types`` → ``params.output_types`` → ``["dense"]``, checked
    against the outputs the profile can produce."""
    if resolved.config.tasks.encode is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support encoding")
    value = options.get("output_types") or requested or ["dense"]
    if not isinstance(value, list) or not value or any(t not in OUTPUT_TYPES for t in value):
        raise invalid_input(
            f"output_types must be a non-empty list of {list(OUTPUT_TYPES)}", param="output_types"
        )
    supported = supported_outputs(resolved)
    unsupported = [t for t in value if t not in supported]
    if unsupported:
        raise invalid_input(
            f"Model '{resolved.routable_id}' does not support output types: {unsupported} (supported: {supported})",
            param="output_types",
        )
    return list(dict.fromkeys(value))


def output_dtype(explicit: Any, options: dict[str, Any]) -> str:
    """``params.output_dtype`` → ``options.output_dtype`` → ``float32``; must be a known dtype."""
    value = explicit or options.get("output_dtype") or "float32"
    if value not in OUTPUT_DTYPES:
        raise invalid_input(
            f"output_dtype must be one of {list(OUTPUT_DTYPES)}, got {value!r}", param="output_dtype"
        )
    return value


def add_special_tokens(options: dict[str, Any]) -> bool:
    """The tokenize route's ``add_special_tokens`` option (default true); must be a boolean."""
    value = options.get("add_special_tokens", True)
    if not isinstance(value, bool):
        raise invalid_input("add_special_tokens must be true or false", param="add_special_tokens")
    return value


CHUNK_POOLINGS = ("mean", "max")
CHUNKINGS = ("separate", "late")


@dataclass(frozen=True)
class ChunkSpec:
    """``overflow_policy: chunk``: token windows of ``size`` (None: as many as the model takes)
    overlapping by ``overlap`` tokens; the item's vector pools the chunks' (``pooling``);
    ``chunking: late`` pools each chunk's span out of one forward pass over the whole text."""

    size: int | None = None
    overlap: int = 32
    pooling: str = "mean"
    late: bool = False


def _positive(options: dict[str, Any], key: str, minimum: int) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise invalid_input(f"{key} must be an integer of at least {minimum}", param=key)
    return value


def chunking(options: dict[str, Any], operation: str) -> ChunkSpec | None:
    """The chunking a request asks for (``overflow_policy: chunk``), checked; None when it does not.
    Encode and score chunk; other operations refuse it."""
    if options.get("overflow_policy") != "chunk":
        return None
    if operation not in ("encode", "score"):
        raise invalid_input(
            f"overflow_policy 'chunk' is for encode and score, not {operation}", param="overflow_policy"
        )
    size = _positive(options, "chunk_size", 8)
    overlap = _positive(options, "chunk_overlap", 0)
    overlap = 32 if overlap is None else overlap
    if size is not None and overlap >= size:
        raise invalid_input("chunk_overlap must be smaller than chunk_size", param="chunk_overlap")
    pooling = options.get("chunk_pooling", "mean")
    if pooling not in CHUNK_POOLINGS:
        raise invalid_input(f"chunk_pooling must be one of {list(CHUNK_POOLINGS)}", param="chunk_pooling")
    mode = options.get("chunking", "separate")
    if mode not in CHUNKINGS:
        raise invalid_input(f"chunking must be one of {list(CHUNKINGS)}", param="chunking")
    if mode == "late" and operation != "encode":
        raise invalid_input("chunking 'late' is for encode", param="chunking")
    return ChunkSpec(size, overlap, pooling, mode == "late")
