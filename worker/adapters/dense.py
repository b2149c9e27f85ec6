"""Dense sentence embeddings from a transformer encoder: mean or CLS pooling, optional L2 norm."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter
from worker.packed import pool_packed


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        masked = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
        return masked.max(dim=1).values
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


class DenseAdapter(HFTextAdapter):
    operations = frozenset({"encode"})
    supports_lora = True
    peft_model: Any = None  # the PeftModel wrapping ``model`` once a LoRA is loaded

    def load(self) -> None:
        from transformers import AutoModel

        self.load_tokenizer()
        self.model = AutoModel.from_pretrained(self.spec.weights_dir, **self.model_kwargs())
        self.model.to(self.spec.device).eval()
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
        return "mean"

    def unload(self) -> None:
        self.model = None
        self.peft_model = None

    # ---- LoRA (peft; inference thread) -----------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        from peft import PeftModel

        if self.peft_model is None:
            self.peft_model = PeftModel.from_pretrained(
                self.model, path, adapter_name=name, is_trainable=False, torch_device=self.spec.device
            )
        else:
            self.peft_model.load_adapter(path, adapter_name=name, is_trainable=False, torch_device=self.spec.device)
        self.peft_model.eval()

    def unload_lora(self, name: str) -> None:
        if self.peft_model is None or name not in self.peft_model.peft_config:
            return
        others = [n for n in self.peft_model.peft_config if n != name]
        if self.peft_model.active_adapter == name and others:
            self.peft_model.set_adapter(others[0])  # every batch activates its own LoRA anyway
        self.peft_model.delete_adapter(name)

    def lora_names(self) -> list[str]:
        return sorted(self.peft_model.peft_config) if self.peft_model is not None else []

    def activate_lora(self, lora: str | None) -> contextlib.AbstractContextManager:
        """Right before a forward pass: the batch's LoRA active, or every LoRA off for the base model."""
        if self.peft_model is None:
            if lora is not None:
                raise RuntimeError(f"LoRA {lora!r} is not loaded")
            return contextlib.nullcontext()
        if lora is None:
            return self.peft_model.disable_adapter()
        self.peft_model.set_adapter(lora)
        return contextlib.nullcontext()

    def memory_bytes(self) -> int:
        return self.param_bytes(getattr(self, "model", None))

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        return self.tokenize(ctx, self.texts_of(ctx, inputs))

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        options = ctx.options
        mode = options.get("pooling") or self.default_pooling
        if self.packed is not None and ctx.lora is None:  # LoRA weights live in peft's modules
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
