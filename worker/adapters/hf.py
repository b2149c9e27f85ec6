"""Shared pieces for adapters built on Hugging Face transformers: tokenisation, padding, dtypes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from worker.adapters.base import Adapter, InputTooLong, Prepared, RequestContext, apply_template

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(precision: str, device: str) -> torch.dtype:
    dtype = DTYPES.get(precision, torch.float32)
    if device == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # fp16 matmuls are slow or missing on CPU; bf16 keeps the range
    return dtype


def attn_implementation(device: str) -> str:
    """flash-attn varlen kernels on CUDA when installed, PyTorch SDPA everywhere else."""
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            return "sdpa"
    return "sdpa"


class HFTextAdapter(Adapter):
    """Tokenises text with the model's fast tokenizer and pads batches to their longest item."""

    tokenizer: Any = None

    def load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.weights_dir)
        model_max = getattr(self.tokenizer, "model_max_length", None) or 512
        if model_max > 100_000:
            model_max = 512
        self.max_length = min(self.spec.config.max_sequence_length or model_max, model_max)
        self.pad_id = self.tokenizer.pad_token_id or 0

    def limit(self, ctx: RequestContext) -> int:
        return min(ctx.max_length or self.max_length, self.max_length)

    def _encode_texts(self, texts: list[str], pairs: list[str] | None, limit: int) -> list[list[int]]:
        enc = self.tokenizer(
            texts,
            pairs,
            truncation=True if pairs is None else "only_second",
            max_length=limit,
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return enc["input_ids"]

    def tokenize(self, ctx: RequestContext, texts: list[str], pairs: list[str] | None = None) -> list[Prepared]:
        """Token ids per text (or text pair), truncated to the limit or refused per overflow policy."""
        limit = self.limit(ctx)
        # one token over the limit tells truncated inputs apart without tokenising twice
        ids = self._encode_texts(texts, pairs, limit + 1)
        too_long = [i for i, seq in enumerate(ids) if len(seq) > limit]
        if too_long:
            if not ctx.truncate:
                first = too_long[0]
                full = self.tokenizer(texts[first], pairs[first] if pairs else None, add_special_tokens=True)
                raise InputTooLong(first, len(full["input_ids"]), limit)
            redo = self._encode_texts(
                [texts[i] for i in too_long], [pairs[i] for i in too_long] if pairs else None, limit
            )
            for i, seq in zip(too_long, redo, strict=True):
                ids[i] = seq
        return [Prepared(cost=len(seq), data=seq, input_tokens=len(seq)) for seq in ids]

    def texts_of(self, ctx: RequestContext, items: list[dict[str, Any]]) -> list[str]:
        return [apply_template(item.get("text") or "", ctx) for item in items]

    def pad(self, batch: list[Prepared]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(p.cost for p in batch)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, p in enumerate(batch):
            ids[row, : p.cost] = p.data
            mask[row, : p.cost] = 1
        device = self.spec.device
        return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)

    def model_kwargs(self) -> dict[str, Any]:
        device = self.spec.device
        return {
            "dtype": torch_dtype(self.spec.precision, device),
            "attn_implementation": attn_implementation(device),
        }

    def param_bytes(self, module: torch.nn.Module | None) -> int:
        if module is None:
            return 0
        return sum(p.numel() * p.element_size() for p in module.parameters())
