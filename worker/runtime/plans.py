"""A request's plan: the forward pass's context and what postprocessing its outputs get.

The checked, typed options (:mod:`protocol.params`, the same functions the gateway checks a request
with) decide both; the two front doors reach these functions through the runtime alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.catalog import Resolved, model_dims
from protocol.params import ChunkSpec, EncodeOptions, ExtractOptions, MuveraConfig, ScoreOptions
from worker.adapters.base import RequestContext
from worker.runtime.postprocess import matryoshka


@dataclass
class Plan:
    resolved: Resolved
    ctx: RequestContext
    output_dtype: str = "float32"
    dims: dict[str, int] = field(default_factory=dict)
    #: outputs the client asked for; ctx.output_types is what the forward pass computes
    requested_outputs: tuple[str, ...] = ()
    #: overflow_policy chunk: how to split over-long inputs (None: truncate or refuse them)
    chunk: ChunkSpec | None = None
    #: dense derived from the multivector (MUVERA's FDE)
    muvera: MuveraConfig | None = None
    #: Matryoshka truncation of dense
    output_dim: int | None = None
    normalize: bool = True


def plan_encode(resolved: Resolved, opts: EncodeOptions) -> Plan:
    ctx = RequestContext(
        op="encode",
        output_types=forward_outputs(opts.output_types, opts.muvera),
        is_query=opts.is_query,
        instruction=opts.instruction,
        lora=opts.lora,
        options_json=RequestContext.canonical_options(opts.options),
        max_length=opts.max_length,
        truncate=opts.truncate,
    )
    dims = model_dims(resolved.config)
    if opts.output_dim is not None:
        dims = {**dims, "dense": opts.output_dim}
    return Plan(
        resolved,
        ctx,
        opts.output_dtype,
        dims,
        opts.output_types,
        opts.chunk,
        opts.muvera,
        opts.output_dim,
        opts.normalize,
    )


def forward_outputs(requested: tuple[str, ...], muvera: MuveraConfig | None) -> tuple[str, ...]:
    """Outputs the forward pass must produce: MUVERA derives dense from multivector."""
    if muvera is not None:
        return tuple(dict.fromkeys(["multivector" if t == "dense" else t for t in requested]))
    return requested


def plan_score(resolved: Resolved, opts: ScoreOptions) -> Plan:
    ctx = RequestContext(
        op="score",
        output_types=(),
        instruction=opts.instruction,
        lora=opts.lora,
        options_json=RequestContext.canonical_options(opts.options),
        max_length=opts.max_length,
        truncate=opts.truncate,
    )
    return Plan(resolved, ctx, chunk=opts.chunk)


def plan_extract(resolved: Resolved, opts: ExtractOptions) -> Plan:
    options = opts.options
    if opts.output_schema:
        options = {**options, "output_schema": opts.output_schema}
    ctx = RequestContext(
        op="extract",
        output_types=(),
        instruction=opts.instruction,
        lora=opts.lora,
        options_json=RequestContext.canonical_options(options),
        labels=opts.labels,
        max_length=opts.max_length,
        truncate=opts.truncate,
    )
    return Plan(resolved, ctx)


def requested_outputs(plan: Plan, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Derived outputs first (MUVERA: multivector → dense; Matryoshka truncation), before
    quantisation, then only the outputs the client asked for (intermediate ones dropped)."""
    requested = plan.requested_outputs
    if plan.muvera is not None:
        from worker.runtime.muvera import muvera_outputs

        raws = muvera_outputs(plan.muvera, raws, is_query=plan.ctx.is_query)
    if plan.output_dim is not None and "dense" in requested:
        raws = matryoshka(raws, plan.output_dim, plan.normalize)
    return [{k: v for k, v in raw.items() if k in requested} for raw in raws]
