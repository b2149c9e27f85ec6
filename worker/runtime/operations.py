"""The runtime's public operations: encode, score, extract and tokenize on decoded request pieces."""

from __future__ import annotations

import functools
import time
from typing import Any, Protocol

from protocol import params as request_params
from protocol import tracing
from protocol.catalog import Catalog, Resolved
from protocol.errors import invalid_input
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

    # ---- public operations -----------------------------------------------------------------
    # ``priority``: the request's class (interactive | bulk) in the model's BatchFormer; the direct
    # path (queue mode, the sidecar batched already) ignores it
    async def encode(
        self,
        spec: str,
        items: list[dict[str, Any]],
        params: dict[str, Any] | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        t0 = time.monotonic()
        params = params or {}
        options = params.get("options") or {}
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_encode(resolved, params)
        return await self.encode_plan(plan, items, direct=direct, t0=t0, priority=priority)

    async def encode_plan(
        self, plan: Plan, items: list[dict[str, Any]], *, direct: bool, t0: float, priority: str = INTERACTIVE
    ) -> Result:
        self._check_items(plan.resolved, items)
        if plan.chunk is not None:
            timing = Timing()
            lm = await self.models.ready_model(plan.resolved)
            chunked, tokens = await self.chunker.encode_chunked(
                lm, plan, items, direct, timing, priority=priority
            )
            timing.total_ms = (time.monotonic() - t0) * 1000
            return Result(chunked, timing, tokens)
        lm = await self.models.ready_model(plan.resolved)
        timing = Timing()
        units, out = await self.executor.infer(
            lm,
            plan.ctx,
            items,
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
        self, plan: Plan, items: list[dict[str, Any]], units: list[Prepared], raws: list[dict[str, Any]]
    ) -> list[dict]:
        raws = requested_outputs(plan, raws)
        return [
            {**encode_item(raw, plan.output_dtype, plan.dims, item.get("id")), **truncation(unit)}
            for raw, item, unit in zip(raws, items, units, strict=True)
        ]

    async def score(
        self,
        spec: str,
        query: dict[str, Any],
        items: list[dict[str, Any]],
        instruction: Any = None,
        options: dict[str, Any] | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        t0 = time.monotonic()
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_score(resolved, instruction, options)
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
            return Result(entries, timing, tokens, query_id=query.get("id"))
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
        return Result(entries, timing, sum(u.input_tokens for u in units), query_id=query.get("id"))

    async def extract(
        self,
        spec: str,
        items: list[dict[str, Any]],
        params: dict[str, Any] | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        t0 = time.monotonic()
        params = params or {}
        options = params.get("options") or {}
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_extract(resolved, params)
        self._check_items(resolved, items)
        lm = await self.models.ready_model(resolved)
        timing = Timing()
        units, raws = await self.executor.infer(lm, plan.ctx, items, direct, timing, priority=priority)
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
        items: list[dict[str, Any]],
        options: dict[str, Any] | None = None,
        *,
        direct: bool = False,
    ) -> Result:
        """The model's own tokenizer over each item's text: tokens, ids, character offsets, count.

        No forward pass, so nothing is batched (``direct`` is accepted for symmetry)."""
        t0 = time.monotonic()
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        merged = request_params.merged_options(resolved, options)
        special = request_params.add_special_tokens(merged)
        if not resolved.config.inputs.text:
            raise invalid_input(f"Model '{resolved.routable_id}' does not take text", param="model")
        self._check_items(resolved, items)
        lm = await self.models.ready_model(resolved)
        if not isinstance(lm.adapter, HFTextAdapter) or lm.adapter.tokenizer is None:
            raise invalid_input(f"Model '{resolved.routable_id}' has no tokenizer to expose", param="model")
        adapter = lm.adapter
        texts = [item.get("text") or "" for item in items]
        spans = await self.executor.offload(adapter.token_spans, texts, special)
        out = [
            {**({"id": item["id"]} if item.get("id") is not None else {}), **s}
            for item, s in zip(items, spans, strict=True)
        ]
        timing = Timing(tokenization_ms=(time.monotonic() - t0) * 1000)
        timing.total_ms = timing.tokenization_ms
        return Result(out, timing, sum(s["count"] for s in spans))

    def _check_items(self, resolved: Resolved, items: list[dict[str, Any]]) -> None:
        limit = self.settings.max_item_text_bytes
        text_model = resolved.config.inputs.text
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise invalid_input(f"Item {i} must be a map", param=f"items.{i}")
            for media in ("images", "audio", "video", "document"):
                if item.get(media) and not getattr(
                    resolved.config.inputs, "image" if media == "images" else media
                ):
                    raise invalid_input(
                        f"Model '{resolved.routable_id}' does not accept {media} input",
                        param=f"items.{i}.{media}",
                    )
            text = item.get("text")
            if text is not None and not isinstance(text, str):
                raise invalid_input(f"Item {i}: text must be a string", param=f"items.{i}.text")
            if (
                text_model
                and text is None
                and not any(item.get(m) for m in ("images", "audio", "video", "document"))
            ):
                raise invalid_input(f"Item {i} has no text", param=f"items.{i}.text")
            if text is not None and len(text.encode("utf-8")) > limit:
                raise invalid_input(f"Item {i}: text is larger than {limit} bytes", param=f"items.{i}.text")
