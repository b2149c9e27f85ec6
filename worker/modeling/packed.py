"""Packed (unpadded) forward for BERT-family encoders, with variable-length attention.

A batch of sequences runs as one ``[total_tokens, hidden]`` tensor plus the offsets where each
sequence starts (``cu_seqlens``), so no position of any matmul, layer norm or activation is spent
on padding. Only attention needs to know where sequences end: it runs variable-length kernels —
``flash_attn_varlen_func`` where flash-attn is installed, else PyTorch's own
``torch.nn.attention.varlen.varlen_attn`` (both CUDA, half precision) — and a reference that runs
scaled-dot-product attention sequence by sequence everywhere else (CPU, float32). The reference is
exact and is what the CPU tests compare the packed forward with.

The encoder reads the weights of an already loaded transformers model (BERT, RoBERTa, XLM-R):
nothing is loaded twice, and LoRA or unknown architectures keep the transformers path. The
query/key/value projections are fused into one matmul; the original modules then view the fused
weight, so memory stays the same.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: transformers ``model_type``s whose encoder layout (and position rule) this module implements
ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})
SUPPORTED_TYPES = frozenset({"bert"}) | ROBERTA_TYPES


@functools.cache
def varlen_kernel() -> tuple[str, Callable[..., Any] | None]:
    """The fused variable-length attention kernel: flash-attn, else PyTorch's own. Looked up at the
    first CUDA forward, not at import: importing torch's (it imports torch._dynamo) took a second of
    every CPU worker's start, and with it of every restart."""
    try:
        from flash_attn import flash_attn_varlen_func

        return "flash_attn", flash_attn_varlen_func
    except ImportError:
        pass
    try:
        from torch.nn.attention.varlen import varlen_attn

        return "torch_varlen", varlen_attn
    except ImportError:
        return "reference", None


@dataclass
class PackedBatch:
    """Token ids of several sequences laid end to end, and where each sequence starts."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token within its sequence (+ offset)
    segments: torch.Tensor  # [T] int64: index of the sequence each token belongs to
    token_types: torch.Tensor | None  # [T] int64, or None for all zeros
    cu_seqlens: torch.Tensor  # [B + 1] int32: start offsets, then the total
    starts: torch.Tensor  # [B] int64: index of each sequence's first token
    lengths: list[int]
    max_len: int

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def build(
        cls,
        seqs: Sequence[Sequence[int]],
        device: str | torch.device,
        *,
        position_offset: int = 0,
        token_types: Sequence[Sequence[int]] | None = None,
    ) -> PackedBatch:
        """Pack on the host, then move in one copy (pinned and asynchronous on CUDA)."""
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        if lengths.size == 0 or int(lengths.min()) < 1:
            raise ValueError("every packed sequence needs at least one token")
        total = int(lengths.sum())
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = 4 if token_types is not None else 3
        host = np.empty((rows, total), dtype=np.int64)
        host[0] = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
        segments = np.repeat(np.arange(len(seqs), dtype=np.int64), lengths)
        host[1] = np.arange(total, dtype=np.int64) - offsets[:-1][segments] + position_offset
        host[2] = segments
        if token_types is not None:
            host[3] = np.fromiter(itertools.chain.from_iterable(token_types), dtype=np.int64, count=total)
        dev = torch.device(device)
        packed = torch.from_numpy(host)
        small = torch.from_numpy(offsets)
        if dev.type == "cuda":
            packed, small = packed.pin_memory(), small.pin_memory()
        packed = packed.to(dev, non_blocking=True)
        small = small.to(dev, non_blocking=True)
        return cls(
            ids=packed[0],
            positions=packed[1],
            segments=packed[2],
            token_types=packed[3] if token_types is not None else None,
            cu_seqlens=small.to(torch.int32),
            starts=small[:-1],
            lengths=lengths.tolist(),
            max_len=int(lengths.max()),
        )


def reference_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """Bidirectional attention within each sequence of a packed ``[T, heads, dim]`` batch."""
    out = torch.empty_like(q)
    start = 0
    for n in lengths:
        s = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1))
        out[s] = o.transpose(0, 1)
        start += n
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Variable-length attention: a fused kernel on CUDA in half precision, the reference elsewhere."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        kernel = varlen_kernel()[1]
        if kernel is not None:
            cu = batch.cu_seqlens
            return kernel(q, k, v, cu, cu, batch.max_len, batch.max_len)
    return reference_varlen_attention(q, k, v, batch.lengths)


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1: tuple[torch.Tensor, torch.Tensor, float]
    up_w: torch.Tensor
    up_b: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]
    down_w: torch.Tensor
    down_b: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor, float]


def _fuse_qkv(attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One [3H, H] weight for query/key/value; the three modules become views of it."""
    mods = (attn.query, attn.key, attn.value)
    with torch.no_grad():
        weight = torch.cat([m.weight for m in mods]).contiguous()
        bias = torch.cat([m.bias for m in mods]).contiguous()
    rows = mods[0].weight.shape[0]
    for i, m in enumerate(mods):
        m.weight.data = weight[i * rows : (i + 1) * rows]
        m.bias.data = bias[i * rows : (i + 1) * rows]
    return weight, bias


def unsupported_reason(base: Any) -> str | None:
    """Why ``base`` (a transformers encoder) cannot run packed, or None when it can."""
    cfg = getattr(base, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"architecture {model_type!r} has no packed forward"
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        return "decoder configurations are not packed"
    if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
        return "only absolute position embeddings are packed"
    try:
        layer = base.encoder.layer[0]
        layer.attention.self.query, layer.attention.output.dense, layer.intermediate.dense  # noqa: B018
        base.embeddings.word_embeddings, base.embeddings.position_embeddings  # noqa: B018
    except AttributeError as exc:
        return f"unexpected module layout ({exc})"
    if any(getattr(m.attention.self.query, "bias", None) is None for m in base.encoder.layer):
        return "bias-free attention projections are not packed"
    return None


class PackedEncoder:
    """The forward pass of a BERT-family encoder over a :class:`PackedBatch`."""

    def __init__(self, base: Any) -> None:
        reason = unsupported_reason(base)
        if reason:
            raise ValueError(reason)
        cfg = base.config
        emb = base.embeddings
        self.model_type = cfg.model_type
        self.heads = int(cfg.num_attention_heads)
        self.hidden = int(cfg.hidden_size)
        self.head_dim = self.hidden // self.heads
        # RoBERTa counts positions from padding_idx + 1; BERT from 0
        self.position_offset = int(emb.padding_idx) + 1 if cfg.model_type in ROBERTA_TYPES else 0
        self.word = emb.word_embeddings.weight
        self.pos = emb.position_embeddings.weight
        types = getattr(emb, "token_type_embeddings", None)
        self.types = types.weight if types is not None else None
        self.emb_ln = (emb.LayerNorm.weight, emb.LayerNorm.bias, float(emb.LayerNorm.eps))
        self.layers = []
        for layer in base.encoder.layer:
            qkv_w, qkv_b = _fuse_qkv(layer.attention.self)
            out, inter, down = layer.attention.output, layer.intermediate, layer.output
            self.layers.append(
                _Layer(
                    qkv_w=qkv_w,
                    qkv_b=qkv_b,
                    out_w=out.dense.weight,
                    out_b=out.dense.bias,
                    ln1=(out.LayerNorm.weight, out.LayerNorm.bias, float(out.LayerNorm.eps)),
                    up_w=inter.dense.weight,
                    up_b=inter.dense.bias,
                    act=inter.intermediate_act_fn,
                    down_w=down.dense.weight,
                    down_b=down.dense.bias,
                    ln2=(down.LayerNorm.weight, down.LayerNorm.bias, float(down.LayerNorm.eps)),
                )
            )

    def pack(
        self, seqs: Sequence[Sequence[int]], device: str, token_types: Sequence[Sequence[int]] | None = None
    ) -> PackedBatch:
        return PackedBatch.build(seqs, device, position_offset=self.position_offset, token_types=token_types)

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """Last hidden state, ``[total_tokens, hidden]``."""
        x = F.embedding(batch.ids, self.word) + F.embedding(batch.positions, self.pos)
        if self.types is not None:
            x = x + (
                F.embedding(batch.token_types, self.types) if batch.token_types is not None else self.types[0]
            )
        x = F.layer_norm(x, (self.hidden,), self.emb_ln[0], self.emb_ln[1], self.emb_ln[2])
        total = x.shape[0]
        for layer in self.layers:
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b).view(total, 3, self.heads, self.head_dim)
            attn = varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], batch).reshape(total, self.hidden)
            x = F.layer_norm(F.linear(attn, layer.out_w, layer.out_b) + x, (self.hidden,), *layer.ln1)
            up = layer.act(F.linear(x, layer.up_w, layer.up_b))
            x = F.layer_norm(F.linear(up, layer.down_w, layer.down_b) + x, (self.hidden,), *layer.ln2)
        return x


def try_packed(model: Any, spec_device: str, option: Any) -> PackedEncoder | None:
    """The packed encoder for ``model`` when wanted and supported, else None (transformers path).

    ``option`` is the model's load-time ``packed`` option: true/false forces it, absent means
    "on CUDA" (where padding and per-shape kernels cost most).
    """
    wanted = str(spec_device).startswith("cuda") if option is None else bool(option)
    if not wanted:
        return None
    base = getattr(model, "base_model", model)
    own = getattr(
        base, "packed_encoder", None
    )  # encoders written here (worker/modeling/gte_new.py) pack themselves
    if callable(own):
        return own()
    reason = unsupported_reason(base)
    if reason:
        log.info("packed forward off for %s: %s", type(model).__name__, reason)
        return None
    return PackedEncoder(base)


def mlm_head(model: Any) -> torch.nn.Module | None:
    """The masked-LM head of a transformers ``*ForMaskedLM`` (BERT: ``cls``; RoBERTa: ``lm_head``).

    Both map hidden states of any leading shape to vocabulary logits, so they apply to packed rows.
    """
    head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
    return head if isinstance(head, torch.nn.Module) else None


def classifier_head(model: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The head of a transformers ``*ForSequenceClassification`` as a function of its ``[B, H]``
    first-token states, or None for layouts it does not know (they keep the transformers path).

    BERT pools (dense + tanh) the first token and classifies; RoBERTa's head takes the first token
    of ``[B, S, H]`` features itself.
    """
    model_type = getattr(model.config, "model_type", None)
    if model_type == "bert" and getattr(getattr(model, "bert", None), "pooler", None) is not None:
        return lambda cls: model.classifier(model.dropout(model.bert.pooler(cls.unsqueeze(1))))
    if model_type in ROBERTA_TYPES:
        return lambda cls: model.classifier(cls.unsqueeze(1))
    return None


# ---- per-sequence reductions over packed rows ------------------------------------------------
def pool_packed(hidden: torch.Tensor, batch: PackedBatch, mode: str) -> torch.Tensor:
    """``[T, H]`` → ``[B, H]`` float32: CLS (first token), last token, max or mean over each sequence."""
    if mode == "cls":
        return hidden[batch.starts].float()
    if mode == "last":
        return hidden[batch.starts + torch.tensor(batch.lengths, device=hidden.device) - 1].float()
    if mode == "max":
        return segment_max(hidden.float(), batch, fill=float("-inf"))
    sums = torch.zeros((batch.size, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, batch.segments, hidden.float())
    lengths = torch.tensor(batch.lengths, dtype=torch.float32).to(hidden.device, non_blocking=True)
    return sums / lengths.unsqueeze(1)


def segment_max(values: torch.Tensor, batch: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Per-sequence maximum of ``[T, D]`` rows; ``fill`` is the identity (0 for non-negative values)."""
    out = torch.full((batch.size, values.shape[1]), fill, dtype=values.dtype, device=values.device)
    index = batch.segments.unsqueeze(1).expand_as(values)
    return out.scatter_reduce_(0, index, values, reduce="amax", include_self=True)
