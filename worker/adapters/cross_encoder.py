"""Cross-encoder reranking for ``score``: each (query, document) pair runs through a sequence
classification head; the runtime sorts the scores and assigns ranks.

The score is the single logit passed through the checkpoint's activation, chosen like
sentence-transformers' ``CrossEncoder``: ``config.json`` → ``sentence_transformers.activation_fn``
if present, else sigmoid for one label and identity otherwise (load-time option ``activation``:
``sigmoid`` | ``identity`` overrides). Two-label heads score with the softmax probability of
label 1. Pairs are truncated longest-first to the model window unless ``overflow_policy`` is
``error``. Runtime options ``query_template`` / ``doc_template`` (``{text}``, ``{instruction}``)
and the request instruction apply to the query side.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.adapters.base import InputTooLong, Prepared, RequestContext, apply_template
from worker.adapters.hf import HFTextAdapter


def default_activation(config_path: Path, num_labels: int) -> str:
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError):
        cfg = {}
    fn = str((cfg.get("sentence_transformers") or {}).get("activation_fn") or "")
    if fn:
        return "sigmoid" if fn.lower().endswith("sigmoid") else "identity"
    return "sigmoid" if num_labels == 1 else "identity"


class CrossEncoderAdapter(HFTextAdapter):
    operations = frozenset({"score"})

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self.load_tokenizer()
        self.model = AutoModelForSequenceClassification.from_pretrained(self.spec.weights_dir, **self.model_kwargs())
        self.model.to(self.spec.device).eval()
        self.num_labels = int(self.model.config.num_labels)
        self.activation = str(
            self.spec.loadtime.get("activation")
            or default_activation(Path(self.spec.weights_dir or "") / "config.json", self.num_labels)
        )
        self.uses_token_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", [])

    def unload(self) -> None:
        self.model = None

    def memory_bytes(self) -> int:
        return self.param_bytes(getattr(self, "model", None))

    def _pairs(self, queries: list[str], docs: list[str], limit: int) -> tuple[list[list[int]], list[list[int]]]:
        enc = self.tokenizer(
            queries, docs, truncation="longest_first", max_length=limit, add_special_tokens=True,
            return_attention_mask=False, return_token_type_ids=True,
        )
        types = enc.get("token_type_ids") or [[0] * len(ids) for ids in enc["input_ids"]]
        return enc["input_ids"], types

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        qctx = replace(ctx, is_query=True)
        queries = [apply_template(q.get("text") or "", qctx) for q, _ in inputs]
        doc_template = ctx.options.get("doc_template")
        docs = [
            str(doc_template).replace("{text}", d.get("text") or "") if doc_template else d.get("text") or ""
            for _, d in inputs
        ]
        limit = self.limit(ctx)
        ids, types = self._pairs(queries, docs, limit + 1)
        too_long = [i for i, seq in enumerate(ids) if len(seq) > limit]
        if too_long:
            if not ctx.truncate:
                first = too_long[0]
                full = self.tokenizer(queries[first], docs[first], add_special_tokens=True)["input_ids"]
                raise InputTooLong(first, len(full), limit)
            redo_ids, redo_types = self._pairs([queries[i] for i in too_long], [docs[i] for i in too_long], limit)
            for i, seq, typ in zip(too_long, redo_ids, redo_types, strict=True):
                ids[i], types[i] = seq, typ
        return [Prepared(cost=len(s), data=(s, t), input_tokens=len(s)) for s, t in zip(ids, types, strict=True)]

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[float]:
        width = max(p.cost for p in batch)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        types = np.zeros((len(batch), width), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, p in enumerate(batch):
            seq, typ = p.data
            ids[row, : len(seq)] = seq
            types[row, : len(typ)] = typ
            mask[row, : len(seq)] = 1
        device = self.spec.device
        kwargs = {"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(mask).to(device)}
        if self.uses_token_types:
            kwargs["token_type_ids"] = torch.from_numpy(types).to(device)
        logits = self.model(**kwargs).logits.float()
        if self.num_labels == 1:
            scores = logits[:, 0]
            if self.activation == "sigmoid":
                scores = torch.sigmoid(scores)
        elif self.num_labels == 2:
            scores = torch.softmax(logits, dim=-1)[:, 1]
        else:
            scores = logits[:, 0]
        return [float(s) for s in scores.cpu().tolist()]
