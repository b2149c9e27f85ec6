"""Turning a request's parameters into a plan: the forward-pass context and the postprocessing.

The HTTP front door and the IPC front door both go through these functions, so precedence and
validation (contract 3.1–3.3) are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.api import OVERFLOW_POLICIES
from protocol.catalog import Resolved, model_dims, supported_outputs
from protocol.errors import invalid_input
from protocol.model_config import OUTPUT_TYPES
from worker.adapters.base import RequestContext
from worker.postprocess import check_dtype


@dataclass
class Plan:
    resolved: Resolved
    ctx: RequestContext
    output_dtype: str = "float32"
    dims: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: outputs the client asked for; ctx.output_types is what the forward pass computes
    requested_outputs: tuple[str, ...] = ()


def merged_options(resolved: Resolved, request_options: dict[str, Any] | None) -> dict[str, Any]:
    if request_options is not None and not isinstance(request_options, dict):
        raise invalid_input("options must be a map", param="options")
    options = {**resolved.runtime_options, **(request_options or {})}
    options.pop("profile", None)
    return options


def _instruction(explicit: Any, options: dict[str, Any]) -> str | None:
    value = explicit if explicit is not None else options.get("instruction")
    if value is not None and not isinstance(value, str):
        raise invalid_input("instruction must be a string", param="instruction")
    return value or None


def _overflow(options: dict[str, Any]) -> bool:
    policy = options.get("overflow_policy", "default")
    if policy not in OVERFLOW_POLICIES:
        raise invalid_input(
            f"overflow_policy must be one of {list(OVERFLOW_POLICIES)}, got {policy!r}", param="overflow_policy"
        )
    return policy != "error"


def _max_length(options: dict[str, Any], is_query: bool) -> int | None:
    value = options.get("query_max_length") if is_query else None
    value = value or options.get("max_seq_length")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise invalid_input("max_seq_length must be a positive integer", param="max_seq_length")
    return value


def _lora(options: dict[str, Any]) -> str | None:
    value = options.get("lora") or options.get("lora_id")
    return str(value) if value else None


def plan_encode(resolved: Resolved, params: dict[str, Any]) -> Plan:
    if resolved.config.tasks.encode is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support encoding")
    options = merged_options(resolved, params.get("options"))
    output_types = options.get("output_types") or params.get("output_types") or ["dense"]
    if (
        not isinstance(output_types, list)
        or not output_types
        or any(t not in OUTPUT_TYPES for t in output_types)
    ):
        raise invalid_input(
            f"output_types must be a non-empty list of {list(OUTPUT_TYPES)}", param="output_types"
        )
    supported = supported_outputs(resolved)
    unsupported = [t for t in output_types if t not in supported]
    if unsupported:
        raise invalid_input(
            f"Model '{resolved.routable_id}' does not support output types: {unsupported} "
            f"(supported: {supported})",
            param="output_types",
        )
    dtype = params.get("output_dtype") or options.get("output_dtype") or "float32"
    check_dtype(dtype)
    is_query = bool(options.get("is_query", False))
    requested = tuple(dict.fromkeys(output_types))
    if "muvera" in options and "dense" in requested:
        from worker.muvera import MuveraConfig

        # a bad MUVERA option is a 400 before any forward pass, not an error after it
        MuveraConfig.from_options(resolved.loadtime_options.get("muvera_config"), options["muvera"])
    ctx = RequestContext(
        op="encode",
        output_types=forward_outputs(requested, options),
        is_query=is_query,
        instruction=_instruction(params.get("instruction"), options),
        lora=_lora(options),
        options_json=RequestContext.canonical_options(options),
        max_length=_max_length(options, is_query),
        truncate=_overflow(options),
    )
    return Plan(resolved, ctx, dtype, model_dims(resolved.config), options, requested)


def forward_outputs(requested: tuple[str, ...], options: dict[str, Any]) -> tuple[str, ...]:
    """Outputs the forward pass must produce: MUVERA derives dense from multivector."""
    if "muvera" in options and "dense" in requested:
        return tuple(dict.fromkeys(["multivector" if t == "dense" else t for t in requested]))
    return requested


def plan_score(resolved: Resolved, instruction: Any, request_options: dict[str, Any] | None) -> Plan:
    if resolved.config.tasks.score is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support scoring")
    options = merged_options(resolved, request_options)
    ctx = RequestContext(
        op="score",
        output_types=(),
        instruction=_instruction(instruction, options),
        lora=None,  # scoring runs on the base model
        options_json=RequestContext.canonical_options(options),
        max_length=_max_length(options, False),
        truncate=_overflow(options),
    )
    return Plan(resolved, ctx, options=options)


def plan_extract(resolved: Resolved, params: dict[str, Any]) -> Plan:
    if resolved.config.tasks.extract is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support extraction")
    options = merged_options(resolved, params.get("options"))
    labels = params.get("labels") or options.get("labels") or []
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise invalid_input("labels must be a list of strings", param="labels")
    ctx = RequestContext(
        op="extract",
        output_types=(),
        instruction=_instruction(params.get("instruction"), options),
        lora=_lora(options),
        options_json=RequestContext.canonical_options(
            {**options, "output_schema": params.get("output_schema")} if params.get("output_schema") else options
        ),
        labels=tuple(labels),
        max_length=_max_length(options, False),
        truncate=_overflow(options),
    )
    return Plan(resolved, ctx, options=options)
