"""Turning a request's parameters into a plan: the forward-pass context and the postprocessing.

The HTTP front door and the IPC front door both go through these functions, so precedence and
validation are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol import params as request_params
from protocol.catalog import Resolved, model_dims
from protocol.errors import invalid_input
from worker.adapters.base import RequestContext


@dataclass
class Plan:
    resolved: Resolved
    ctx: RequestContext
    output_dtype: str = "float32"
    dims: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: outputs the client asked for; ctx.output_types is what the forward pass computes
    requested_outputs: tuple[str, ...] = ()


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
    options = request_params.merged_options(resolved, params.get("options"))
    requested = tuple(request_params.output_types(resolved, options, params.get("output_types")))
    dtype = request_params.output_dtype(params.get("output_dtype"), options)
    is_query = bool(options.get("is_query", False))
    if "muvera" in options and "dense" in requested:
        from worker.muvera import MuveraConfig

        # a bad MUVERA option is a 400 before any forward pass, not an error after it
        MuveraConfig.from_options(resolved.loadtime_options.get("muvera_config"), options["muvera"])
    ctx = RequestContext(
        op="encode",
        output_types=forward_outputs(requested, options),
        is_query=is_query,
        instruction=request_params.instruction(params.get("instruction"), options),
        lora=_lora(options),
        options_json=RequestContext.canonical_options(options),
        max_length=_max_length(options, is_query),
        truncate=request_params.truncates(options),
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
    options = request_params.merged_options(resolved, request_options)
    ctx = RequestContext(
        op="score",
        output_types=(),
        instruction=request_params.instruction(instruction, options),
        lora=None,  # scoring runs on the base model
        options_json=RequestContext.canonical_options(options),
        max_length=_max_length(options, False),
        truncate=request_params.truncates(options),
    )
    return Plan(resolved, ctx, options=options)


def plan_extract(resolved: Resolved, params: dict[str, Any]) -> Plan:
    if resolved.config.tasks.extract is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support extraction")
    options = request_params.merged_options(resolved, params.get("options"))
    labels = params.get("labels") or options.get("labels") or []
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise invalid_input("labels must be a list of strings", param="labels")
    ctx = RequestContext(
        op="extract",
        output_types=(),
        instruction=request_params.instruction(params.get("instruction"), options),
        lora=_lora(options),
        options_json=RequestContext.canonical_options(
            {**options, "output_schema": params.get("output_schema")} if params.get("output_schema") else options
        ),
        labels=tuple(labels),
        max_length=_max_length(options, False),
        truncate=request_params.truncates(options),
    )
    return Plan(resolved, ctx, options=options)
