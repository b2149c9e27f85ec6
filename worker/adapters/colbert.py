"""Late-interaction (ColBERT) multi-vector embeddings, and MaxSim scoring.

A checkpoint is a BERT-like encoder plus a bias-free linear projection to the token dim. Both
published layouts load:

- Stanford ``colbert-ai`` (e.g. answerdotai/answerai-colbert-small-v1): ``linear.weight`` next to
  the encoder weights in ``model.safetensors``; settings in ``artifact.metadata``
  (``query_maxlen``, ``doc_maxlen``, ``attend_to_mask_tokens``, ``mask_punctuation``, …).
- PyLate / sentence-transformers: the projection in ``1_Dense/``; settings in
  ``config_sentence_transformers.json`` (``query_length``, ``document_length``, …).

Queries get the query marker after ``[CLS]`` and are padded with ``[MASK]`` to the query
length (query augmentation), every position becoming an output vector; documents get the
document marker and drop punctuation tokens (the skiplist) from their outputs. Vectors are
L2-normalised (runtime option ``normalize``, default true).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter
from worker.modeling.checkpoint import read_state_dict


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def find_projection(root: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (out, in) projection weight and optional bias from either checkpoint layout."""
    for folder in (root / "1_Dense", root):  # PyLate / sentence-transformers, then Stanford colbert-ai
        try:
            tensors = read_state_dict(folder)
        except FileNotFoundError:
            continue
        if "linear.weight" in tensors:
            return tensors["linear.weight"], tensors.get("linear.bias")
    raise FileNotFoundError(f"no ColBERT projection (linear.weight) under {root}")


class ColBERTAdapter(HFTextAdapter):
    operations = frozenset({"encode", "score"})
    supports_lora = True
    linear: torch.nn.Linear | None = None  # the projection to the token dimension (loaded)

    def load(self) -> None:
        from transformers import AutoModel

        root = Path(self.spec.weights_dir or "")
        self.load_model(AutoModel)
        weight, bias = find_projection(root)
        dtype = next(self.model.parameters()).dtype
        self.linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)
        self.linear.to(device=self.spec.device, dtype=dtype).eval()
        self._settings(root)

    def _settings(self, root: Path) -> None:
        meta = _read_json(root / "artifact.metadata")
        st = _read_json(root / "config_sentence_transformers.json")
        opts = self.spec.loadtime
        tok = self.tokenizer

        def marker(meta_key: str, st_key: str, default: str) -> str:
            value = opts.get(meta_key) or meta.get(meta_key) or (st.get(st_key) or "").strip() or default
            return str(value)

        self.query_marker = tok.convert_tokens_to_ids(marker("query_token_id", "query_prefix", "[unused0]"))
        self.doc_marker = tok.convert_tokens_to_ids(marker("doc_token_id", "document_prefix", "[unused1]"))
        self.query_length = int(
            opts.get("query_maxlen") or meta.get("query_maxlen") or st.get("query_length") or 32
        )
        self.doc_length = int(
            opts.get("doc_maxlen") or meta.get("doc_maxlen") or st.get("document_length") or self.max_length
        )
        self.doc_length = min(self.doc_length, self.max_length)
        self.query_length = min(self.query_length, self.max_length)
        self.attend_to_expansion = bool(
            opts.get(
                "attend_to_mask_tokens",
                meta.get("attend_to_mask_tokens", st.get("attend_to_expansion_tokens", False)),
            )
        )
        self.query_expansion = bool(opts.get("query_expansion", st.get("do_query_expansion", True)))
        self.mask_id = tok.mask_token_id if tok.mask_token_id is not None else self.pad_id
        skip_punct = bool(opts.get("mask_punctuation", meta.get("mask_punctuation", True)))
        listed = st.get("skiplist_words")
        words = listed if isinstance(listed, list) else list(string.punctuation)
        self.skiplist = frozenset(
            ids[0] for w in (words if skip_punct else []) if (ids := tok.encode(w, add_special_tokens=False))
        )

    def unload(self) -> None:
        super().unload()
        self.linear = None

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self.param_bytes(getattr(self, "linear", None))

    # ---- preparation -----------------------------------------------------------------------
    def limit(self, ctx: RequestContext) -> int:
        base = self.query_length if ctx.is_query else self.doc_length
        return max(2, min(ctx.max_length or base, self.max_length)) - 1  # one slot for the marker

    def _units(self, ctx: RequestContext, texts: list[str]) -> list[Prepared]:
        units = self.tokenize(ctx, texts)
        marker = self.query_marker if ctx.is_query else self.doc_marker
        width = self.limit(ctx) + 1
        for u in units:
            ids = [u.data[0], marker, *u.data[1:]]
            real = len(ids)
            if ctx.is_query and self.query_expansion and real < width:
                ids += [self.mask_id] * (width - real)
            u.data = (ids, real)
            u.cost = len(ids)
            u.input_tokens = real
            if u.full_tokens:
                u.full_tokens += 1  # the marker counts on both sides
        return units

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        if ctx.op == "score":
            from dataclasses import replace

            qctx = replace(ctx, is_query=True)
            dctx = replace(ctx, is_query=False)
            queries = self._units(qctx, self.texts_of(qctx, [q for q, _ in inputs]))
            docs = self._units(dctx, self.texts_of(dctx, [d for _, d in inputs]))
            return [
                Prepared(
                    cost=q.cost + d.cost,
                    data=(q.data, d.data),
                    input_tokens=q.input_tokens + d.input_tokens,
                    full_tokens=(q.full_tokens or q.input_tokens) + (d.full_tokens or d.input_tokens)
                    if q.truncated or d.truncated
                    else 0,
                )
                for q, d in zip(queries, docs, strict=True)
            ]
        return self._units(ctx, self.texts_of(ctx, inputs))

    # ---- forward ---------------------------------------------------------------------------
    def _embed(
        self, seqs: list[tuple[list[int], int]], is_query: bool, normalize: bool, lora: str | None = None
    ) -> list[torch.Tensor]:
        """Token vectors (float32, on the model device) per sequence."""
        width = max(len(ids) for ids, _ in seqs)
        ids_np = np.full((len(seqs), width), self.pad_id, dtype=np.int64)
        attn = np.zeros((len(seqs), width), dtype=np.int64)
        for row, (ids, real) in enumerate(seqs):
            ids_np[row, : len(ids)] = ids
            attn[row, : len(ids) if (is_query and self.attend_to_expansion) else real] = 1
        device = self.spec.device
        ids_t = torch.from_numpy(ids_np).to(device)
        mask_t = torch.from_numpy(attn).to(device)
        with self.activate_lora(lora):
            hidden = self.model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
        assert self.linear is not None  # loaded
        vecs = self.linear(hidden).float()
        if normalize:
            vecs = torch.nn.functional.normalize(vecs, p=2, dim=-1)
        out = []
        for row, (ids, real) in enumerate(seqs):
            if is_query:
                out.append(vecs[row, : len(ids)])
            else:
                keep = [i for i in range(real) if ids[i] not in self.skiplist]
                out.append(vecs[row, keep])
        return out

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[Any]:
        normalize = bool(ctx.options.get("normalize", True))
        if ctx.op == "score":
            queries: dict[tuple[int, ...], Any] = {}
            for p in batch:
                queries.setdefault(tuple(p.data[0][0]), p.data[0])
            qkeys = list(queries)
            qvecs = dict(
                zip(qkeys, self._embed(list(queries.values()), True, normalize, ctx.lora), strict=True)
            )
            dvecs = self._embed([p.data[1] for p in batch], False, normalize, ctx.lora)
            return [float(maxsim(qvecs[tuple(p.data[0][0])], d)) for p, d in zip(batch, dvecs, strict=True)]
        vecs = self._embed([p.data for p in batch], ctx.is_query, normalize, ctx.lora)
        return [{"multivector": v.cpu().numpy()} for v in vecs]


def maxsim(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Σ over query tokens of the best dot product with any document token."""
    if doc.shape[0] == 0:
        return torch.zeros((), dtype=query.dtype)
    return (query @ doc.T).max(dim=1).values.sum()
