"""Reading a checkpoint directory's own files: its ``config.json`` and its tensors.

For the networks and heads the worker builds itself (worker/modeling/gte_new.py, sentence-transformers
``Dense`` projections, ColBERT's linear layer) rather than through transformers' loaders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def checkpoint_config(weights_dir: str | Path | None) -> dict[str, Any] | None:
    """The checkpoint's ``config.json`` as a dict, or None where there is none."""
    if not weights_dir:
        return None
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one file: safetensors by its suffix, else a torch pickle (weights only)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(str(path), map_location="cpu", weights_only=True)


def read_state_dict(weights_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: ``model.safetensors`` (or its shards), else ``pytorch_model.bin``;
    FileNotFoundError where there is neither."""
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_tensors(weights_dir / shard))
        return state
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (weights_dir / name).is_file():
            return load_tensors(weights_dir / name)
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {weights_dir}")
