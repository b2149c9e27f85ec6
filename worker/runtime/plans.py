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
from worker.runtime.postprocess import matryoshka


@dataclass
class Plan:
    resolved: Resolved
    ctx: RequestContext
    output_dtype: str = "float32"
    dims: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: outputs the client asked for; ctx.output_types is what the forward pass computes
    requested_outputs: tuple[str, ...] = ()
    #: overflow_policy chunk: how to split over-long inputs (None: truncate or refuse them)
    chunk: request_params.ChunkSpec | None = None


def _lora(options: dict[str, Any]) -> str | None:
    value = options.get("lora") or options.get("lora_id")
    return str(value) if value else None


def plan_encode(resolved: Resolved, params: dict[str, Any]) -> Plan:
    options = request_params.merged_options(resolved, params.get("options"))
    requested = tuple(request_params.output_types(resolved, options, params.get("output_types")))
    request_params.pooling(options)
    dtype = request_params.output_dtype(params.get("output_dtype"), options)
    is_query = bool(options.get("is_query", False))
    if "muvera" in options and "dense" in requested:
        from worker.runtime.muvera import MuveraConfig

        # a bad MUVERA option is a 400 before any forward pass, not an error after it
        MuveraConfig.from_options(resolved.loadtime_options.get("muvera_config"), options["muvera"])
    ctx = RequestContext(
        op="encode",
        output_types=forward_outputs(requested, options),
        is_query=is_query,
        instruction=request_params.instruction(params.get("instruction"), options),
        lora=_lora(options),
        options_json=RequestContext.canonical_options(options),
        max_length=request_params.max_length(options, is_query),
        truncate=request_params.truncates(options),
    )
    dims = model_dims(resolved.config)
    if options.get("output_dim") is not None:
        dims = {**dims, "dense": _output_dim(options["output_dim"], dims.get("dense"))}
    chunk = request_params.chunking(options, "encode")
    if chunk is not None and (requested != ("dense",) or "muvera" in options):
        raise invalid_input(
            "overflow_policy 'chunk' gives dense vectors only (output_types ['dense'], no MUVERA)",
            param="overflow_policy",
        )
    return Plan(resolved, ctx, dtype, dims, options, requested, chunk)


def _output_dim(value: Any, native: int | None) -> int:
    """Matryoshka truncation: 1 ≤ output_dim ≤ the model's dense dimension."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise invalid_input("output_dim must be a positive integer", param="output_dim")
    if native is None:
        raise invalid_input("output_dim needs a model with dense output", param="output_dim")
    if value > native:
        raise invalid_input(
            f"output_dim={value} is larger than the model's dimension {native}", param="output_dim"
        )
    return value


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
        lora=_lora(options),  # cross-encoders and LLM rerankers take LoRA adapters too
        options_json=RequestContext.canonical_options(options),
        max_length=request_params.max_length(options, False),
        truncate=request_params.truncates(options),
    )
    return Plan(resolved, ctx, options=options, chunk=request_params.chunking(options, "score"))


def plan_extract(resolved: Resolved, params: dict[str, Any]) -> Plan:
    if resolved.config.tasks.extract is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support extraction")
    options = request_params.merged_options(resolved, params.get("options"))
    request_params.chunking(options, "extract")  # refused: extraction does not chunk
    labels = params.get("labels") or options.get("labels") or []
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise invalid_input("labels must be a list of strings", param="labels")
    ctx = RequestContext(
        op="extract",
        output_types=(),
        instruction=request_params.instruction(params.get("instruction"), options),
        lora=_lora(options),
        options_json=RequestContext.canonical_options(
            {**options, "output_schema": params.get("output_schema")}
            if params.get("output_schema")
            else options
        ),
        labels=tuple(labels),
        max_length=request_params.max_length(options, False),
        truncate=request_params.truncates(options),
    )
    return Plan(resolved, ctx, options=options)


def requested_outputs(plan: Plan, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Derived outputs first (MUVERA: multivector → dense; Matryoshka truncation), before
    quantisation, then only the outputs the client asked for (intermediate ones dropped)."""
    requested = plan.requested_outputs
    if "muvera" in plan.options and "dense" in requested:
        from worker.runtime.muvera import muvera_outputs

        raws = muvera_outputs(plan, raws)
    if plan.options.get("output_dim") is not None and "dense" in requested:
        raws = matryoshka(raws, int(plan.options["output_dim"]), bool(plan.options.get("normalize", True)))
    return [{k: v for k, v in raw.items() if k in requested} for raw in raws]
