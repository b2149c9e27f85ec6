"""Alibaba's GTE "NewModel" encoder, written here so its checkpoints load without remote code.

``NovaSearch/stella_en_400M_v5``, ``Alibaba-NLP/gte-{base,large}-en-v1.5`` and
``gte-multilingual-base`` say ``model_type: new`` and point ``auto_map`` at the hub repository
``Alibaba-NLP/new-impl``, whose code cannot run here (no hub) and which we do not depend on. This
module builds the same network from the checkpoint's own ``config.json`` and loads its safetensors
under their own key names (bare, or with the ``new.`` prefix of the task-head classes).

The architecture (GTE v1.5; the facts the implementation rests on):

- embeddings: word + token type (when ``type_vocab_size`` > 0; type 0 when the input has none),
  then LayerNorm (always a LayerNorm, whatever ``layer_norm_type`` says); no absolute positions
  with ``position_embedding_type: rope``;
- post-LN layers: ``x = attn_ln(x + o_proj(attention(x)))``, ``x = mlp_ln(x + mlp(x))``, where
  ``layer_norm_type`` is ``layer_norm`` (weight and bias) or ``rms_norm`` (weight only);
- attention: one fused ``qkv_proj`` with bias (``pack_qkv``, the default; else ``q_proj``,
  ``k_proj``, ``v_proj``, fused here at load) split into query, key, value in that order; rotary
  positions on query and key, rotate-half style (``cos·x + rotate_half(x)·sin`` with the
  frequencies repeated over both halves); scale ``1/sqrt(head_dim)``; ``o_proj`` with bias;
  optionally queries scaled by ``log(length) / log(max_position_embeddings)``
  (``logn_attention_scale``, clipped below at 1 with ``logn_attention_clip1``);
- gated MLP: ``up_gate_proj`` (no bias) gives ``[up, gate]`` in that order, then
  ``down_proj(act(gate) * up)`` with bias;
- RoPE frequencies: ``1 / theta^(2i/d)``; ``rope_scaling: {type: ntk, factor: f}`` raises the base
  to ``theta·f`` and divides every frequency by ``f^(2/d)``; with ``mixed_b`` the base stays and
  frequency ``i`` (counted from 1) is divided by ``exp(ln(f)/(d/2)^b · i^b)``.

Two forwards share the layers: padded ``[B, S]`` batches with an attention mask (what the dense
adapter and late chunking run) and packed rows (``worker.modeling.packed``: variable-length attention, no
padding), which the adapters pick as they do for BERT.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.modeling.checkpoint import checkpoint_config, read_state_dict
from worker.modeling.packed import PackedBatch, PackedEncoder, varlen_attention

log = logging.getLogger(__name__)

#: key prefixes of heads a bare encoder does not use (task-head checkpoints carry them)
IGNORED_PREFIXES = ("pooler.", "classifier.", "lm_head.", "cls.")


def is_new_model(config: dict[str, Any] | None) -> bool:
    """A GTE NewModel checkpoint: ``model_type: new``, or architecture ``NewModel`` / ``NewFor...``."""
    if not config:
        return False
    archs = [str(a) for a in config.get("architectures") or []]
    return config.get("model_type") == "new" or any(a == "NewModel" or a.startswith("NewFor") for a in archs)


@dataclass
class NewConfig:
    """The ``config.json`` fields the network reads, with new-impl's defaults."""

    vocab_size: int = 30528
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    type_vocab_size: int = 1
    layer_norm_type: str = "layer_norm"
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    pack_qkv: bool = True
    logn_attention_scale: bool = False
    logn_attention_clip1: bool = False
    pad_token_id: int | None = 0
    model_type: str = "new"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NewConfig:
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in data.items() if k in known and (v is not None or k == "rope_scaling")})
        if cfg.position_embedding_type != "rope":
            raise ValueError(
                f"GTE NewModel: position_embedding_type {cfg.position_embedding_type!r} is not supported"
            )
        if cfg.layer_norm_type not in ("layer_norm", "rms_norm"):
            raise ValueError(f"GTE NewModel: unknown layer_norm_type {cfg.layer_norm_type!r}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError("GTE NewModel: hidden_size is not a multiple of num_attention_heads")
        scaling = cfg.rope_scaling
        if scaling is not None and (scaling.get("type") or scaling.get("rope_type")) != "ntk":
            raise ValueError(f"GTE NewModel: rope_scaling {scaling!r} is not supported (only type 'ntk')")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rope_inv_freq(cfg: NewConfig) -> torch.Tensor:
    """Rotary frequencies ``[head_dim / 2]`` (float32), NTK-scaled where the config says so."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    scaling = cfg.rope_scaling
    if not scaling:
        return 1.0 / (float(cfg.rope_theta) ** exponents)
    factor = float(scaling["factor"])
    mixed_b = scaling.get("mixed_b")
    if mixed_b is None:
        return 1.0 / ((float(cfg.rope_theta) * factor) ** exponents) / factor ** (2 / dim)
    a = math.log(factor) / (dim / 2) ** float(mixed_b)
    lam = torch.exp(a * torch.arange(1, dim // 2 + 1, dtype=torch.float32) ** float(mixed_b))
    return 1.0 / (float(cfg.rope_theta) ** exponents) / lam


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _norm(cfg: NewConfig) -> nn.Module:
    if cfg.layer_norm_type == "rms_norm":
        return RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class NewEmbeddings(nn.Module):
    def __init__(self, cfg: NewConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.token_type_embeddings = (
            nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size > 0 else None
        )
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, ids: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if self.token_type_embeddings is not None:
            x = x + (
                self.token_type_embeddings(token_types)
                if token_types is not None
                else self.token_type_embeddings.weight[0]
            )
        return self.LayerNorm(x)


class NewAttention(nn.Module):
    def __init__(self, cfg: NewConfig) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class NewGatedMLP(nn.Module):
    def __init__(self, cfg: NewConfig) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.intermediate = cfg.intermediate_size
        self.up_gate_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gate_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class NewLayer(nn.Module):
    def __init__(self, cfg: NewConfig) -> None:
        super().__init__()
        self.attention: NewAttention = NewAttention(cfg)
        self.mlp: NewGatedMLP = NewGatedMLP(cfg)
        self.attn_ln = _norm(cfg)
        self.mlp_ln = _norm(cfg)


class NewEncoder(nn.Module):
    def __init__(self, cfg: NewConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(NewLayer(cfg) for _ in range(cfg.num_hidden_layers))


@dataclass
class EncoderOutput:
    """What the adapters read of a transformers model's output."""

    last_hidden_state: torch.Tensor


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GteNewModel(nn.Module):
    """The bare encoder; parameter names are the hub's (``embeddings.*``, ``encoder.layer.N.*``)."""

    def __init__(self, cfg: NewConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = NewEmbeddings(cfg)
        self.encoder = NewEncoder(cfg)
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        # float32 whatever the weights' dtype (the original computes cos/sin in float32), so no buffer
        self._inv_freq = rope_inv_freq(cfg)

    # ---- shared pieces ---------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, 1, head_dim]`` (the 1 broadcasts over heads)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.to(torch.float32).unsqueeze(-1) * self._inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _logn_scale(self, lengths: torch.Tensor) -> torch.Tensor | None:
        cfg = self.config
        if not cfg.logn_attention_scale:
            return None
        scale = lengths.to(torch.float32).log() / math.log(cfg.max_position_embeddings)
        return scale.clamp(min=1.0) if cfg.logn_attention_clip1 else scale

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        q_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The encoder layers over ``x`` of shape ``[..., hidden]``; ``attend`` takes and returns
        ``[..., heads, head_dim]`` query, key, value."""
        lead = x.shape[:-1]
        for layer in cast("list[NewLayer]", self.encoder.layer):
            qkv = layer.attention.qkv_proj(x).view(*lead, 3, self.heads, self.head_dim)
            q, k, v = qkv.unbind(dim=-3)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if q_scale is not None:
                q = q * q_scale.to(q.dtype)
            attn = attend(q, k, v).reshape(*lead, -1)
            x = layer.attn_ln(x + layer.attention.o_proj(attn))
            x = layer.mlp_ln(x + layer.mlp(x))
        return x

    # ---- padded batches --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> EncoderOutput:
        """Right- or left-padded ``[B, S]`` ids; padded positions are never attended to."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]: keys each query may see
        scale = self._logn_scale(attention_mask.sum(dim=1))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep
            )
            return out.transpose(1, 2)

        q_scale = scale[:, None, None, None] if scale is not None else None
        return EncoderOutput(self._layers(x, cos, sin, attend, q_scale))

    # ---- packed rows -----------------------------------------------------------------------------
    def packed(self, batch: PackedBatch) -> torch.Tensor:
        """Last hidden state ``[total_tokens, hidden]`` of a packed batch (positions from 0)."""
        x = self.embeddings(batch.ids, batch.token_types)
        cos, sin = self._rope(batch.positions, x.dtype)
        lengths = torch.tensor(batch.lengths, device=batch.ids.device)
        scale = self._logn_scale(lengths)
        q_scale = scale[batch.segments][:, None, None] if scale is not None else None
        return self._layers(x, cos, sin, lambda q, k, v: varlen_attention(q, k, v, batch), q_scale)

    def packed_encoder(self) -> NewPackedEncoder:
        return NewPackedEncoder(self)


class NewPackedEncoder(PackedEncoder):
    """:class:`worker.modeling.packed.PackedEncoder`'s interface (``pack``, call) over a :class:`GteNewModel`."""

    def __init__(self, model: GteNewModel) -> None:  # not super().__init__: it reads BERT's weights
        self.model = model
        self.model_type = "new"
        self.position_offset = 0

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        return self.model.packed(batch)


# ---- loading ---------------------------------------------------------------------------------------
def hub_keys_to_ours(state: dict[str, torch.Tensor], cfg: NewConfig) -> dict[str, torch.Tensor]:
    """The hub's key names as this module's: ``new.`` prefix dropped, heads and buffers left out,
    separate q/k/v projections (``pack_qkv: false``) fused into ``qkv_proj``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key.removeprefix("new.")
        if name.startswith(IGNORED_PREFIXES) or name.endswith("position_ids"):
            continue
        out[name] = value
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}.attention."
        if f"{p}q_proj.weight" in out:
            for part in ("weight", "bias"):
                out[f"{p}qkv_proj.{part}"] = torch.cat([out.pop(f"{p}{n}_proj.{part}") for n in "qkv"])
    return out


def load_new_model(
    weights_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> GteNewModel:
    """A GTE NewModel checkpoint directory as a :class:`GteNewModel` in eval mode on ``device``."""
    root = Path(weights_dir)
    data = checkpoint_config(root)
    if not is_new_model(data):
        raise ValueError(f"{root} is not a GTE NewModel checkpoint (config.json model_type is not 'new')")
    assert data is not None
    cfg = NewConfig.from_dict(data)
    with torch.device("meta"):
        model = GteNewModel(cfg)
    model._inv_freq = rope_inv_freq(cfg)  # built on the meta device above; the real one
    state = hub_keys_to_ours(read_state_dict(root), cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"GTE NewModel checkpoint {root} does not match its config: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}"
        )
    return model.to(device=device, dtype=dtype).eval()
