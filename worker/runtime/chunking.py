"""Long inputs without truncation (``overflow_policy: chunk``).

Encode: each text is split into token windows (``chunk_size`` tokens, ``chunk_overlap`` shared
with the next, ends moved to word boundaries where one is near), cut at the tokens' character
offsets; the chunk texts run through the batcher like
any items, so the chunks of many items share batches. Each item answers its chunks
(``start``/``end`` characters, a ``dense`` vector each) and a pooled ``dense`` (``chunk_pooling``:
mean or max, re-normalised). ``chunking: late`` runs the whole text through the model at once
(in windows of the model's limit beyond it, each holding whole chunks) and mean-pools each chunk's
tokens out of that pass, so every chunk vector has seen its context.

Score: each document is split the same way (windows sized to fit beside the query), every
(query, window) pair is scored, and the document gets its best window's score (MaxP) with that
window's ``span``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import numpy as np

from protocol.api import Item
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.params import ChunkSpec
from protocol.priority import INTERACTIVE
from worker.adapters.base import Prepared, RequestContext, apply_template
from worker.adapters.hf import HFTextAdapter
from worker.models.loaded import LoadedModel
from worker.runtime.plans import Plan, requested_outputs
from worker.runtime.postprocess import encode_item
from worker.runtime.results import Timing, rank_scores

Span = tuple[int, int]  # [start, end) characters of a chunk in its item's text

T = TypeVar("T")


class Inference(Protocol):
    """How the chunker runs its chunks (:class:`worker.runtime.executor.Executor`)."""

    async def infer(
        self,
        lm: LoadedModel,
        ctx: RequestContext,
        inputs: list[Any],
        direct: bool,
        timing: Timing,
        *,
        priority: str = INTERACTIVE,
    ) -> tuple[list[Prepared], list[Any]]: ...

    async def offload(self, fn: Callable[..., T], *args: Any) -> T: ...


def word_starts(offsets: list[list[int]]) -> list[bool]:
    """Which tokens begin a word: the first, and any that a gap (whitespace) separates from the one
    before (word pieces and punctuation glued to a word do not)."""
    return [i == 0 or offsets[i][0] > offsets[i - 1][1] for i in range(len(offsets))]


def windows(
    count: int, size: int, overlap: int, starts: list[bool] | None = None, limit: int | None = None
) -> list[Span]:
    """Token windows [start, end) over ``count`` tokens, at most ``size`` long, the next starting
    ``overlap`` tokens before the previous one ends, the last one ending at ``count``.

    With ``starts`` (word starts) windows end and begin at word boundaries where one lies in reach
    (an end moves back at most half a window; a start moves forward, never up to the previous end,
    so no token is left out). Stops once there are more than ``limit`` windows.
    """
    if count <= size:
        return [(0, count)]
    out: list[Span] = []
    start = 0
    while True:
        end = min(start + size, count)
        if starts is not None and end < count:
            cut = end
            while cut > start + size // 2 and not starts[cut]:
                cut -= 1
            if starts[cut]:
                end = cut
        out.append((start, end))
        if end == count or (limit is not None and len(out) > limit):
            return out
        start = max(end - overlap, start + 1)
        if starts is not None:
            at = start
            while at < end and not starts[at]:
                at += 1
            start = at if at < end else start  # no word start before the end: keep the overlap


def char_spans(text: str, offsets: list[list[int]], spans: list[Span]) -> list[Span]:
    """Token windows of ``text`` as character spans, from its tokens' offsets (no special tokens)."""
    if len(spans) == 1:
        return [(0, len(text))]
    return [(offsets[a][0], offsets[b - 1][1]) for a, b in spans]


def _pool(vectors: np.ndarray, mode: str, normalize: bool) -> np.ndarray:
    pooled = vectors.max(axis=0) if mode == "max" else vectors.mean(axis=0)
    if normalize:
        pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
    return np.asarray(pooled, dtype=np.float32)


class Chunker:
    def __init__(self, inference: Inference, *, max_chunks_per_item: int) -> None:
        self.inference = inference
        self.max_chunks_per_item = max_chunks_per_item

    def _text_adapter(self, lm: LoadedModel) -> HFTextAdapter:
        if not isinstance(lm.adapter, HFTextAdapter) or lm.adapter.tokenizer is None:
            raise invalid_input(
                f"Model '{lm.model_id}' cannot chunk its inputs (no text tokenizer)", param="overflow_policy"
            )
        return lm.adapter

    def _chunk_spans(
        self, adapter: HFTextAdapter, spec: ChunkSpec, texts: list[str], room: int
    ) -> tuple[list[list[Span]], list[list[Span]]]:
        """Every text's chunks as character spans and as token windows, within ``room`` tokens each
        and at most ``max_chunks_per_item`` per text (else 400 INPUT_TOO_LONG)."""
        size = min(spec.size or room, room)
        if size < 1:
            raise invalid_input("the model's limit leaves no room for a chunk", param="chunk_size")
        overlap = min(spec.overlap, size // 2)
        limit = self.max_chunks_per_item
        chars, toks = [], []
        for i, (text, tokens) in enumerate(
            zip(texts, adapter.token_spans(texts, special=False), strict=True)
        ):
            spans = windows(tokens["count"], size, overlap, word_starts(tokens["offsets"]), limit)
            if len(spans) > limit:
                raise SIEError(
                    ErrorCode.INPUT_TOO_LONG,
                    f"Item {i} has {tokens['count']} tokens: more chunks of {size} than the limit of {limit} "
                    "chunks per item",
                    param=f"items.{i}",
                    max_chunks=limit,
                )
            chars.append(char_spans(text, tokens["offsets"], spans))
            toks.append(spans)
        return chars, toks

    def _room(self, adapter: HFTextAdapter, ctx: RequestContext) -> int:
        """Tokens a chunk may take: the model's limit less the specials and template around it."""
        around = int(adapter.token_spans([apply_template("", ctx)], special=True)[0]["count"])
        return adapter.limit(ctx) - around

    # ---- encode ------------------------------------------------------------------------------
    async def encode_chunked(
        self,
        lm: LoadedModel,
        plan: Plan,
        items: Sequence[Item],
        direct: bool,
        timing: Timing,
        *,
        priority: str = INTERACTIVE,
    ) -> tuple[list[dict[str, Any]], int]:
        """Encode answers with chunks, and the input tokens the forward passes saw."""
        assert plan.chunk is not None
        adapter = self._text_adapter(lm)
        texts = [item.text or "" for item in items]
        room = self._room(adapter, plan.ctx)
        spans, token_windows = await self.inference.offload(
            self._chunk_spans, adapter, plan.chunk, texts, room
        )
        if plan.chunk.late:
            vectors, tokens = await self._late_vectors(
                lm, adapter, plan, texts, spans, token_windows, room, direct, timing, priority=priority
            )
        else:
            sub = [
                Item(text=text[s:e])
                for text, item_spans in zip(texts, spans, strict=True)
                for s, e in item_spans
            ]
            units, raws = await self.inference.infer(lm, plan.ctx, sub, direct, timing, priority=priority)
            vectors = [np.asarray(r["dense"], dtype=np.float32) for r in requested_outputs(plan, raws)]
            tokens = sum(u.input_tokens for u in units)
        normalize = plan.normalize
        out, k = [], 0
        for item, item_spans in zip(items, spans, strict=True):
            mine = vectors[k : k + len(item_spans)]
            k += len(item_spans)
            entry = encode_item(
                {"dense": _pool(np.stack(mine), plan.chunk.pooling, normalize)},
                plan.output_dtype,
                plan.dims,
                item.id,
            )
            entry["chunks"] = [
                {"start": s, "end": e, **encode_item({"dense": v}, plan.output_dtype, plan.dims, None)}
                for (s, e), v in zip(item_spans, mine, strict=True)
            ]
            out.append(entry)
        return out, tokens

    async def _late_vectors(
        self,
        lm: LoadedModel,
        adapter: HFTextAdapter,
        plan: Plan,
        texts: list[str],
        spans: list[list[Span]],
        token_windows: list[list[Span]],
        room: int,
        direct: bool,
        timing: Timing,
        *,
        priority: str = INTERACTIVE,
    ) -> tuple[list[np.ndarray], int]:
        """Late chunking: windows of whole chunks up to the model's limit run once each; every chunk
        mean-pools its own tokens' states from its window (normalised when the model normalises)."""
        from worker.adapters.dense import DenseAdapter

        if not isinstance(adapter, DenseAdapter):
            raise invalid_input(f"Model '{lm.model_id}' does not support chunking 'late'", param="chunking")
        if apply_template("x", plan.ctx) != "x":
            raise invalid_input(
                "chunking 'late' runs the text as it is: no instruction or template", param="chunking"
            )
        # windows: runs of consecutive chunks whose tokens fit in the model's limit together
        groups: list[tuple[int, int, list[int]]] = []  # (item, first character of the window, its chunks)
        for i, windows_i in enumerate(token_windows):
            current: list[int] = []
            for c, (_, end) in enumerate(windows_i):
                if current and end - windows_i[current[0]][0] > room:
                    groups.append((i, spans[i][current[0]][0], current))
                    current = []
                current.append(c)
            groups.append((i, spans[i][current[0]][0], current))
        sub = [Item(text=texts[i][start : spans[i][chunks[-1]][1]]) for i, start, chunks in groups]
        ctx = replace(plan.ctx, output_types=("token_states",))
        units, raws = await self.inference.infer(lm, ctx, sub, direct, timing, priority=priority)
        window_tokens = await self.inference.offload(adapter.token_spans, [x.text or "" for x in sub], True)
        normalize = plan.normalize
        per_chunk: dict[tuple[int, int], np.ndarray] = {}
        for (i, start, chunks), raw, toks in zip(groups, raws, window_tokens, strict=True):
            states = np.asarray(raw["token_states"], dtype=np.float32)
            offsets = toks["offsets"][: len(states)]
            for c in chunks:
                s, e = spans[i][c][0] - start, spans[i][c][1] - start
                rows = [t for t, (a, b) in enumerate(offsets) if b > a and a >= s and b <= e]
                vec = states[rows].mean(axis=0) if rows else states.mean(axis=0)
                if normalize:
                    vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
                per_chunk[(i, c)] = vec
        vectors = [per_chunk[(i, c)] for i, item_spans in enumerate(spans) for c in range(len(item_spans))]
        return vectors, sum(u.input_tokens for u in units)

    # ---- score -------------------------------------------------------------------------------
    async def score_chunked(
        self,
        lm: LoadedModel,
        plan: Plan,
        query: Item,
        items: Sequence[Item],
        direct: bool,
        timing: Timing,
        *,
        priority: str = INTERACTIVE,
    ) -> tuple[list[dict[str, Any]], int]:
        """MaxP: every document's windows scored beside the query; a document scores its best window
        and says which (``span``: start/end characters) and of how many (``chunks``)."""
        adapter = self._text_adapter(lm)
        room = adapter.document_room(plan.ctx, query.text or "")
        if room is None:
            raise invalid_input(
                f"Model '{lm.model_id}' does not score in chunks (cross-encoders and LLM rerankers do)",
                param="overflow_policy",
            )
        assert plan.chunk is not None
        texts = [item.text or "" for item in items]
        spans, _ = await self.inference.offload(self._chunk_spans, adapter, plan.chunk, texts, room)
        pairs = [
            (query, Item(text=text[s:e]))
            for text, item_spans in zip(texts, spans, strict=True)
            for s, e in item_spans
        ]
        units, scores = await self.inference.infer(lm, plan.ctx, pairs, direct, timing, priority=priority)
        best_scores, best_units, extra, k = [], [], [], 0
        for item_spans in spans:
            mine = [float(x) for x in scores[k : k + len(item_spans)]]
            j = max(range(len(mine)), key=mine.__getitem__)
            best_scores.append(mine[j])
            best_units.append(units[k + j])
            extra.append(
                {"span": {"start": item_spans[j][0], "end": item_spans[j][1]}, "chunks": len(item_spans)}
            )
            k += len(item_spans)
        return rank_scores(best_scores, items, best_units, extra), sum(u.input_tokens for u in units)
