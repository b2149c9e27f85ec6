"""The runtime's public operations: encode, score and extract on decoded request pieces."""

from __future__ import annotations

import time
from typing import Any

from protocol.errors import invalid_input
from worker.adapters.base import Prepared
from worker.execution import Execution
from worker.plans import Plan, plan_encode, plan_extract, plan_score
from worker.postprocess import encode_item, matryoshka
from worker.results import Result, Timing, extract_item, rank_scores


class Operations(Execution):
    # ---- public operations -----------------------------------------------------------------
    async def encode(self, spec: str, items: list[dict[str, Any]], params: dict[str, Any] | None = None,
                     *, direct: bool = False) -> Result:
        t0 = time.monotonic()
        params = params or {}
        options = params.get("options") or {}
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_encode(resolved, params)
        return await self.encode_plan(plan, items, direct=direct, t0=t0)

    async def encode_plan(self, plan: Plan, items: list[dict[str, Any]], *, direct: bool, t0: float) -> Result:
        self._check_items(plan.resolved, items)
        lm = await self._ready_model(plan.resolved)
        timing = Timing()
        units, raws = await self._infer(lm, plan.ctx, items, direct, timing)
        t = time.monotonic()
        out = await self._postprocess(self._encode_outputs, plan, raws, items, units)
        timing.postprocessing_ms = (time.monotonic() - t) * 1000
        timing.total_ms = (time.monotonic() - t0) * 1000
        return Result(out, timing, sum(u.input_tokens for u in units))

    def _encode_outputs(self, plan: Plan, raws: list[dict[str, Any]], items: list[dict[str, Any]],
                        units: list[Prepared]) -> list[dict]:
        raws = requested_outputs(plan, raws)
        return [
            encode_item(raw, plan.output_dtype, plan.dims, item.get("id"), unit.full_tokens if unit.truncated else 0,
                        unit.input_tokens)
            for raw, item, unit in zip(raws, items, units, strict=True)
        ]

    async def score(self, spec: str, query: dict[str, Any], items: list[dict[str, Any]],
                    instruction: Any = None, options: dict[str, Any] | None = None,
                    *, direct: bool = False) -> Result:
        t0 = time.monotonic()
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_score(resolved, instruction, options)
        if not items:
            raise invalid_input("Field 'items' must not be empty", param="items")
        if len(items) > self.settings.max_score_items:
            raise invalid_input(f"At most {self.settings.max_score_items} items can be scored at once", param="items")
        self._check_items(resolved, [query, *items])
        lm = await self._ready_model(resolved)
        timing = Timing()
        units, scores = await self._infer(lm, plan.ctx, [(query, item) for item in items], direct, timing)
        t = time.monotonic()
        entries = rank_scores(scores, items)
        timing.postprocessing_ms = (time.monotonic() - t) * 1000
        timing.total_ms = (time.monotonic() - t0) * 1000
        return Result(entries, timing, sum(u.input_tokens for u in units), query_id=query.get("id"))

    async def extract(self, spec: str, items: list[dict[str, Any]], params: dict[str, Any] | None = None,
                      *, direct: bool = False) -> Result:
        t0 = time.monotonic()
        params = params or {}
        options = params.get("options") or {}
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_extract(resolved, params)
        self._check_items(resolved, items)
        lm = await self._ready_model(resolved)
        timing = Timing()
        units, raws = await self._infer(lm, plan.ctx, items, direct, timing)
        out = [extract_item(raw, item, i) for i, (raw, item) in enumerate(zip(raws, items, strict=True))]
        timing.total_ms = (time.monotonic() - t0) * 1000
        return Result(out, timing, sum(u.input_tokens for u in units))


def requested_outputs(plan: Plan, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Derived outputs first (MUVERA: multivector → dense; Matryoshka truncation), before
    quantisation, then only the outputs the client asked for (intermediate ones dropped)."""
    requested = plan.requested_outputs
    if "muvera" in plan.options and "dense" in requested:
        from worker.muvera import muvera_outputs

        raws = muvera_outputs(plan, raws)
    if plan.options.get("output_dim") is not None and "dense" in requested:
        raws = matryoshka(raws, int(plan.options["output_dim"]), bool(plan.options.get("normalize", True)))
    return [{k: v for k, v in raw.items() if k in requested} for raw in raws]
