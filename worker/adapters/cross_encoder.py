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

import torch

from worker.adapters.base import Prepared, RequestContext, apply_template
from worker.adapters.hf import HFTextAdapter
from worker.modeling.packed import classifier_head


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
    supports_lora = True

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self.load_model(AutoModelForSequenceClassification)
        self.enable_packed(self.model)
        self.head = classifier_head(self.model)
        if self.head is None:  # a head layout the packed path does not know: all transformers
            self.packed = None
        self.num_labels = int(self.model.config.num_labels)
        self.activation = str(
            self.spec.loadtime.get("activation")
            or default_activation(Path(self.spec.weights_dir or "") / "config.json", self.num_labels)
        )
        self.uses_token_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", [])

    def document_room(self, ctx: RequestContext, query: str) -> int | None:
        qctx = replace(ctx, is_query=True)
        doc_template = ctx.options.get("doc_template")
        empty_doc = str(doc_template).replace("{text}", "") if doc_template else ""
        return self.limit(ctx) - self.full_length(apply_template(query, qctx), empty_doc, special=True)

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        qctx = replace(ctx, is_query=True)
        queries = [apply_template(q.text or "", qctx) for q, _ in inputs]
        doc_template = ctx.options.get("doc_template")
        docs = [
            str(doc_template).replace("{text}", d.text or "") if doc_template else d.text or ""
            for _, d in inputs
        ]
        encs = self.encode_checked(ctx, queries, docs, "longest_first")
        return [
            Prepared(cost=len(e.ids), data=(e.ids, e.type_ids), input_tokens=len(e.ids), full_tokens=n)
            for e, n in zip(encs, self.full_counts(encs, queries, docs), strict=True)
        ]

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[float]:
        if self.runs_packed(ctx):
            logits = self._packed_logits(batch)
        else:
            with self.activate_lora(ctx.lora):
                logits = self._padded_logits(batch)
        logits = logits.float()
        if self.num_labels == 1:
            scores = logits[:, 0]
            if self.activation == "sigmoid":
                scores = torch.sigmoid(scores)
        elif self.num_labels == 2:
            scores = torch.softmax(logits, dim=-1)[:, 1]
        else:
            scores = logits[:, 0]
        return [float(s) for s in scores.cpu().tolist()]

    def _packed_logits(self, batch: list[Prepared]) -> torch.Tensor:
        types = [p.data[1] for p in batch] if self.uses_token_types else None
        packed = self.pack([p.data[0] for p in batch], types)
        hidden = self.encode_packed(packed)
        assert self.head is not None  # the packed path is off without a head it knows
        return self.head(hidden[packed.starts])

    def _padded_logits(self, batch: list[Prepared]) -> torch.Tensor:
        return self.model(**self.pair_inputs([p.data for p in batch])).logits
