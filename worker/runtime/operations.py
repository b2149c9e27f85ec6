"""The runtime's public operations: encode, score, extract and tokenize on typed request pieces
(:mod:`protocol.api`), checked by :mod:`protocol.params` like the gateway checks them."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Protocol

from protocol import tracing
from protocol.api import EncodeParams, ExtractParams, Item, ScoreParams, TokenizeParams
from protocol.catalog import Catalog, Resolved
from protocol.errors import invalid_input
from protocol.params import (
    EncodeOptions,
    ExtractOptions,
    ScoreOptions,
    TokenizeOptions,
    check_items,
    encode_options,
    extract_options,
    score_options,
    tokenize_options,
)
from protocol.priority import INTERACTIVE
from worker.adapters.base import Prepared
from worker.adapters.hf import HFTextAdapter
from worker.metrics import WorkerMetrics
from worker.models.loaded import LoadedModel
from worker.runtime.chunking import Chunker
from worker.runtime.executor import Executor
from worker.runtime.plans import Plan, plan_encode, plan_extract, plan_score, requested_outputs
from worker.runtime.postprocess import encode_item
from worker.runtime.results import Result, Timing, extract_item, rank_scores, truncation
from worker.settings import WorkerSettings


class ModelSource(Protocol):
    """Where operations get their models (:class:`worker.models.registry.ModelRegistry`)."""

    async def ready_model(self, resolved: Resolved) -> LoadedModel:
        """The loaded model, or the SIEError a request gets meanwhile (MODEL_LOADING, a failed load)."""
        ...


class Operations:
    def __init__(
        self,
        settings: WorkerSettings,
        catalog: Catalog,
        *,
        models: ModelSource,
        executor: Executor,
        chunker: Chunker,
        metrics: WorkerMetrics,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.models = models
        self.executor = executor
        self.chunker = chunker
        self.metrics = metrics

    def resolve(self, spec: str) -> Resolved:
        """The profile a job's model spec names (its params were resolved at the front door)."""
        return self.catalog.resolve(spec)

    # ---- public operations -----------------------------------------------------------------
    # ``priority``: the request's class (interactive | bulk): its queue in the model's BatchFormer,
    # or on the direct path (queue mode, the sidecar batched already) whether the batch may run
    # inside a running bulk forward (worker/batching/preemption.py)
    async def encode(
        self,
        spec: str,
        items: Sequence[Item],
        params: EncodeParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        resolved = self.catalog.resolve(spec, params.options if params else None)
        return await self.run_encode(
            resolved, encode_options(resolved, params), items, direct=direct, priority=priority
        )

    async def run_encode(
        self,
        resolved: Resolved,
        opts: EncodeOptions,
        items: Sequence[Item],
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        """Encode ``items`` with params checked already (a job's, or :meth:`encode`'s)."""
        t0 = time.monotonic()
        plan = plan_encode(resolved, opts)
        self._check_items(resolved, items)
        if plan.chunk is not None:
            timing = Timing()
            lm = await self.models.ready_model(resolved)
            chunked, tokens = await self.chunker.encode_chunked(
                lm, plan, items, direct, timing, priority=priority
            )
            timing.total_ms = (time.monotonic() - t0) * 1000
            return Result(chunked, timing, tokens)
        lm = await self.models.ready_model(resolved)
        timing = Timing()
        units, out = await self.executor.infer(
            lm,
            plan.ctx,
            list(items),
            direct,
            timing,
            priority=priority,
            post=functools.partial(self._encode_outputs, plan, items),
        )
        timing.total_ms = (time.monotonic() - t0) * 1000
        self.metrics.observe_request(lm.model_id, timing)
        return Result(
            out, timing, sum(u.input_tokens for u in units), item_tokens=[u.input_tokens for u in units]
        )

    def _encode_outputs(
        self, plan: Plan, items: Sequence[Item], units: list[Prepared], raws: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        raws = requested_outputs(plan, raws)
        return [
            {**encode_item(raw, plan.output_dtype, plan.dims, item.id), **truncation(unit)}
            for raw, item, unit in zip(raws, items, units, strict=True)
        ]

    async def score(
        self,
        spec: str,
        query: Item,
        items: Sequence[Item],
        params: ScoreParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        resolved = self.catalog.resolve(spec, params.options if params else None)
        return await self.run_score(
            resolved, score_options(resolved, params), query, items, direct=direct, priority=priority
        )

    async def run_score(
        self,
        resolved: Resolved,
        opts: ScoreOptions,
        query: Item,
        items: Sequence[Item],
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        """Score ``items`` against ``query`` with params checked already."""
        t0 = time.monotonic()
        plan = plan_score(resolved, opts)
        if not items:
            raise invalid_input("Field 'items' must not be empty", param="items")
        if len(items) > self.settings.max_score_items:
            raise invalid_input(
                f"At most {self.settings.max_score_items} items can be scored at once", param="items"
            )
        self._check_items(resolved, [query, *items])
        timing = Timing()
        if plan.chunk is not None:
            lm = await self.models.ready_model(resolved)
            entries, tokens = await self.chunker.score_chunked(
                lm, plan, query, items, direct, timing, priority=priority
            )
            timing.total_ms = (time.monotonic() - t0) * 1000
            return Result(entries, timing, tokens, query_id=query.id)
        lm = await self.models.ready_model(resolved)
        units, scores = await self.executor.infer(
            lm, plan.ctx, [(query, item) for item in items], direct, timing, priority=priority
        )
        t = time.monotonic()
        with tracing.span("worker.postprocess"):
            entries = rank_scores(scores, items, units)
        timing.postprocessing_ms = (time.monotonic() - t) * 1000
        timing.total_ms = (time.monotonic() - t0) * 1000
        self.metrics.observe_request(lm.model_id, timing)
        return Result(entries, timing, sum(u.input_tokens for u in units), query_id=query.id)

    async def extract(
        self,
        spec: str,
        items: Sequence[Item],
        params: ExtractParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        resolved = self.catalog.resolve(spec, params.options if params else None)
        return await self.run_extract(
            resolved, extract_options(resolved, params), items, direct=direct, priority=priority
        )

    async def run_extract(
        self,
        resolved: Resolved,
        opts: ExtractOptions,
        items: Sequence[Item],
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        """Extract from ``items`` with params checked already."""
        t0 = time.monotonic()
        plan = plan_extract(resolved, opts)
        self._check_items(resolved, items)
        lm = await self.models.ready_model(resolved)
        timing = Timing()
        units, raws = await self.executor.infer(lm, plan.ctx, list(items), direct, timing, priority=priority)
        out = [
            extract_item(raw, item, i, unit)
            for i, (raw, item, unit) in enumerate(zip(raws, items, units, strict=True))
        ]
        timing.total_ms = (time.monotonic() - t0) * 1000
        self.metrics.observe_request(lm.model_id, timing)
        return Result(
            out, timing, sum(u.input_tokens for u in units), item_tokens=[u.input_tokens for u in units]
        )

    async def tokenize(
        self,
        spec: str,
        items: Sequence[Item],
        params: TokenizeParams | None = None,
        *,
        direct: bool = False,
    ) -> Result:
        """The model's own tokenizer over each item's text: tokens, ids, character offsets, count.

        No forward pass, so nothing is batched (``direct`` is accepted for symmetry)."""
        resolved = self.catalog.resolve(spec, params.options if params else None)
        return await self.run_tokenize(resolved, tokenize_options(resolved, params), items)

    async def run_tokenize(self, resolved: Resolved, opts: TokenizeOptions, items: Sequence[Item]) -> Result:
        """Tokenize ``items`` with params checked already."""
        t0 = time.monotonic()
        self._check_items(resolved, items)
        lm = await self.models.ready_model(resolved)
        if not isinstance(lm.adapter, HFTextAdapter) or lm.adapter.tokenizer is None:
            raise invalid_input(f"Model '{resolved.routable_id}' has no tokenizer to expose", param="model")
        adapter = lm.adapter
        texts = [item.text or "" for item in items]
        spans = await self.executor.offload(adapter.token_spans, texts, opts.add_special_tokens)
        out = [
            {**({"id": item.id} if item.id is not None else {}), **s}
            for item, s in zip(items, spans, strict=True)
        ]
        timing = Timing(tokenization_ms=(time.monotonic() - t0) * 1000)
        timing.total_ms = timing.tokenization_ms
        return Result(out, timing, sum(s["count"] for s in spans))

    def _check_items(self, resolved: Resolved, items: Sequence[Item]) -> None:
        check_items(resolved, items, self.settings.max_item_text_bytes)
