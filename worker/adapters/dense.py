"""Dense sentence embeddings from a transformer encoder or decoder: mean, CLS, max or last-token pooling,
optional L2 norm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter
from worker.packed import pool_packed


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Mean, CLS, max or last-token pooling of right-padded ``(batch, seq, hidden)`` states.

    ``last`` is the pooling of decoder-LLM embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral): a
    causal model's last real token is the only one that has seen the whole text.
    """
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if mode == "max":
        masked = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
        return masked.max(dim=1).values
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


class DenseAdapter(HFTextAdapter):
    operations = frozenset({"encode"})
    supports_lora = True

    def load(self) -> None:
        from transformers import AutoModel

        self.load_model(AutoModel)
        self.enable_packed(self.model)
        self.default_pooling = self._pooling_from_files()

    def _pooling_from_files(self) -> str:
        """sentence-transformers checkpoints say their pooling in 1_Pooling/config.json."""
        cfg = Path(self.spec.weights_dir or "") / "1_Pooling" / "config.json"
        if cfg.exists():
            data = json.loads(cfg.read_text())
            if data.get("pooling_mode_cls_token"):
                return "cls"
            if data.get("pooling_mode_max_tokens"):
                return "max"
            if data.get("pooling_mode_lasttoken"):
                return "last"
        return "mean"

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        return self.tokenize(ctx, self.texts_of(ctx, inputs))

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        if "token_states" in ctx.output_types:  # late chunking pools spans of these itself
            ids, mask = self.pad(batch)
            with self.activate_lora(ctx.lora):
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float().cpu().numpy()
            return [{"token_states": hidden[i, : p.cost]} for i, p in enumerate(batch)]
        options = ctx.options
        mode = options.get("pooling") or self.default_pooling
        if self.runs_packed(ctx):
            packed = self.pack([p.data for p in batch])
            vectors = pool_packed(self.packed(packed), packed, mode)
        else:
            ids, mask = self.pad(batch)
            with self.activate_lora(ctx.lora):
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = pool(hidden, mask, mode)
        if options.get("normalize", True):
            vectors = torch.nn.functional.normalize(vectors.float(), p=2, dim=-1)
        out = vectors.float().cpu().numpy()
        return [{"dense": out[i]} for i in range(len(batch))]
