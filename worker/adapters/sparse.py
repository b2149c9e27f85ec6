"""SPLADE sparse embeddings: max over tokens of log(1 + ReLU(MLM logits)), as vocabulary indices/values."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter
from worker.modeling.packed import mlm_head, segment_max


def splade_vectors(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq, vocab) logits → (batch, vocab) SPLADE weights."""
    activated = torch.log1p(torch.relu(logits.float())) * mask.unsqueeze(-1).float()
    return activated.max(dim=1).values


def to_sparse(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    indices = np.flatnonzero(row).astype(np.int32)
    return indices, row[indices].astype(np.float32)


class SpladeAdapter(HFTextAdapter):
    operations = frozenset({"encode"})
    supports_lora = True

    def load(self) -> None:
        from transformers import AutoModelForMaskedLM

        self.load_model(AutoModelForMaskedLM)
        self.enable_packed(self.model)
        self.head = mlm_head(self.model)
        if self.head is None:
            self.packed = None

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        return self.tokenize(ctx, self.texts_of(ctx, inputs))

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        if self.runs_packed(ctx):
            packed = self.pack([p.data for p in batch])
            assert self.head is not None  # the packed path is off without a head it knows
            logits = self.head(self.encode_packed(packed))
            weights = segment_max(torch.log1p(torch.relu(logits.float())), packed).cpu().numpy()
        else:
            ids, mask = self.pad(batch)
            with self.activate_lora(ctx.lora):
                logits = self.model(input_ids=ids, attention_mask=mask).logits
            weights = splade_vectors(logits, mask).cpu().numpy()
        return [{"sparse": to_sparse(weights[i])} for i in range(len(batch))]
