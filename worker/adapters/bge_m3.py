"""BGE-M3: dense, sparse (lexical weights) and multi-vector (ColBERT) outputs from one forward pass.

Layout of the checkpoint (BAAI/bge-m3): an XLM-RoBERTa encoder plus ``colbert_linear.pt``
(hidden → hidden, with bias) and ``sparse_linear.pt`` (hidden → 1, with bias).

- dense: the ``[CLS]`` state, L2-normalised;
- sparse: ``relu(sparse_linear(h))`` per token, the maximum per vocabulary id, special tokens
  (cls/eos/sep/pad/unk) dropped and zero weights left out;
- multivector: ``colbert_linear(h)`` for every real token after ``[CLS]``, L2-normalised.

Only the outputs the request needs are computed (MUVERA requests get the multivector).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter


def _linear(path: Path, dtype: torch.dtype, device: str) -> torch.nn.Linear:
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    weight, bias = state["weight"], state.get("bias")
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.load_state_dict(state)
    return layer.to(device=device, dtype=dtype).eval()


class BGEM3Adapter(HFTextAdapter):
    operations = frozenset({"encode"})
    colbert: torch.nn.Linear | None = None  # the multi-vector head (loaded)
    sparse: torch.nn.Linear | None = None  # the lexical-weight head (loaded)

    def load(self) -> None:
        from transformers import AutoModel

        root = Path(self.spec.weights_dir or "")
        self.load_tokenizer()
        self.model = AutoModel.from_pretrained(str(root), **self.model_kwargs())
        self.model.to(self.spec.device).eval()
        dtype = next(self.model.parameters()).dtype
        self.colbert = _linear(root / "colbert_linear.pt", dtype, self.spec.device)
        self.sparse = _linear(root / "sparse_linear.pt", dtype, self.spec.device)
        tok = self.tokenizer
        self.special = {
            i
            for i in (
                tok.cls_token_id,
                tok.eos_token_id,
                tok.sep_token_id,
                tok.pad_token_id,
                tok.unk_token_id,
            )
            if i is not None
        }

    def unload(self) -> None:
        self.model = self.colbert = self.sparse = None

    def memory_bytes(self) -> int:
        return sum(self.param_bytes(getattr(self, n, None)) for n in ("model", "colbert", "sparse"))

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        return self.tokenize(ctx, self.texts_of(ctx, inputs))

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        ids, mask = self.pad(batch)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        wanted = set(ctx.output_types)
        outs: list[dict[str, Any]] = [{} for _ in batch]
        if "dense" in wanted:
            dense = torch.nn.functional.normalize(hidden[:, 0].float(), p=2, dim=-1).cpu().numpy()
            for i, out in enumerate(outs):
                out["dense"] = dense[i]
        if "sparse" in wanted:
            assert self.sparse is not None  # loaded
            weights = torch.relu(self.sparse(hidden)).float().squeeze(-1).cpu().numpy()
            for i, (out, p) in enumerate(zip(outs, batch, strict=True)):
                best: dict[int, float] = {}
                for tok_id, w in zip(p.data, weights[i, : p.cost].tolist(), strict=True):
                    if tok_id in self.special or w <= 0:
                        continue
                    if w > best.get(tok_id, 0.0):
                        best[tok_id] = w
                order = sorted(best)
                out["sparse"] = (
                    np.array(order, dtype=np.int32),
                    np.array([best[k] for k in order], dtype=np.float32),
                )
        if "multivector" in wanted:
            colbert = self.colbert
            assert colbert is not None  # loaded
            vecs = torch.nn.functional.normalize(colbert(hidden[:, 1:]).float(), p=2, dim=-1).cpu().numpy()
            for i, (out, p) in enumerate(zip(outs, batch, strict=True)):
                out["multivector"] = vecs[i, : p.cost - 1]
        return outs
