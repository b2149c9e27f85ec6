"""Dense sentence embeddings from a transformer encoder or decoder: mean, CLS, max or last-token pooling,
an optional sentence-transformers Dense projection, optional L2 norm.

Load-time option ``projection``: the checkpoint's sub-directory of a sentence-transformers ``Dense``
module (``config.json`` with ``in_features``, ``out_features``, ``bias``, ``activation_function``;
``linear.weight``/``linear.bias`` in ``model.safetensors`` or ``pytorch_model.bin``), applied after
pooling and before normalisation, as sentence-transformers does (stella_en_400M_v5: ``2_Dense_1024``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter
from worker.modeling.checkpoint import read_state_dict
from worker.modeling.packed import pool_packed


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


#: sentence-transformers Dense activations (the class path's last name) and what they compute
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": torch.relu,
    "GELU": torch.nn.functional.gelu,
    "Sigmoid": torch.sigmoid,
}


class Projection:
    """A sentence-transformers ``Dense`` module: ``activation(x @ W.T + b)``, run in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        self.weight = weight.float()
        self.bias = bias.float() if bias is not None else None
        self.activation = ACTIVATIONS[activation]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(torch.nn.functional.linear(x.float(), self.weight, self.bias))

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


def load_projection(root: Path, sub: str, device: str) -> Projection:
    """The ``Dense`` module in ``root/sub``, on ``device``; ValueError where its files do not make one."""
    folder = root / sub
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"projection {sub!r}: no {cfg_path}")
    cfg = json.loads(cfg_path.read_text())
    activation = str(cfg.get("activation_function") or "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if activation not in ACTIVATIONS:
        known = ", ".join(ACTIVATIONS)
        raise ValueError(f"projection {sub!r}: activation {activation!r} is not supported ({known})")
    try:
        state = read_state_dict(folder)
    except FileNotFoundError:
        raise ValueError(
            f"projection {sub!r}: no model.safetensors or pytorch_model.bin in {folder}"
        ) from None
    weight = state.get("linear.weight")
    bias = state.get("linear.bias") if cfg.get("bias", True) else None
    shape = (int(cfg["out_features"]), int(cfg["in_features"]))
    if weight is None or tuple(weight.shape) != shape or (cfg.get("bias", True) and bias is None):
        raise ValueError(f"projection {sub!r}: linear.weight/bias do not match {shape} (config.json)")
    return Projection(weight.to(device), bias.to(device) if bias is not None else None, activation)


class DenseAdapter(HFTextAdapter):
    operations = frozenset({"encode"})
    supports_lora = True
    cpu_bf16_safe = (
        True  # cosine >= 0.9999 against fp32 for MiniLM (tests/integration/lifecycle/test_cpu_precision.py)
    )
    projection: Projection | None = None

    def load(self) -> None:
        from transformers import AutoModel

        self.load_model(AutoModel)
        self.enable_packed(self.model)
        self.default_pooling = self._pooling_from_files()
        sub = self.spec.loadtime.get("projection")
        if sub:
            self.projection = load_projection(Path(self.spec.weights_dir or ""), str(sub), self.spec.device)

    def runs_packed(self, ctx: RequestContext) -> bool:
        """Token states (late chunking) come from the padded forward."""
        return super().runs_packed(ctx) and "token_states" not in ctx.output_types

    def memory_bytes(self) -> int:
        return super().memory_bytes() + (self.projection.nbytes() if self.projection is not None else 0)

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
                states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if self.projection is not None:  # affine, so spans' means of these equal projected means
                states = self.projection(states)
            hidden = states.cpu().numpy()
            return [{"token_states": hidden[i, : p.cost]} for i, p in enumerate(batch)]
        options = ctx.options
        mode = options.get("pooling") or self.default_pooling
        if self.runs_packed(ctx):
            packed = self.pack([p.data for p in batch])
            vectors = pool_packed(self.encode_packed(packed), packed, mode)
        else:
            ids, mask = self.pad(batch)
            with self.activate_lora(ctx.lora):
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = pool(hidden, mask, mode)
        if self.projection is not None:
            vectors = self.projection(vectors)
        if options.get("normalize", True):
            vectors = torch.nn.functional.normalize(vectors.float(), p=2, dim=-1)
        out = vectors.float().cpu().numpy()
        return [{"dense": out[i]} for i in range(len(batch))]
