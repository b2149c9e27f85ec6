"""Tiny random-weight visual retrievers: ColPali (PaliGemma: 2-layer Gemma, 2-layer SigLIP on 32x32
images, 16 image tokens) and ColQwen2 (Qwen2-VL: 2-layer text and vision, 4-pixel patches merged
2x2, dynamic resolution), each saved with its processor and a tokenizer built here from a small
vocabulary (no hub: a byte-fallback Gemma BPE and a byte-level Qwen2 BPE, both without merges, so
every character or byte is one token)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    ColPaliConfig,
    ColPaliForRetrieval,
    ColPaliProcessor,
    ColQwen2Config,
    ColQwen2ForRetrieval,
    ColQwen2Processor,
    GemmaTokenizer,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    SiglipImageProcessorPil,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

DIM = 16  # the token vectors' size
TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def gemma_tokenizer() -> GemmaTokenizer:
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:?!\n":
        vocab.setdefault(ch, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[])


def qwen2_tokenizer() -> Qwen2Tokenizer:
    vocab = {"<|endoftext|>": 0}
    for ch in bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=QWEN_SPECIALS)


def build_colpali(path: Path) -> Path:
    tok = gemma_tokenizer()
    proc = ColPaliProcessor(
        image_processor=SiglipImageProcessorPil(size={"height": 32, "width": 32}, image_seq_length=16),
        tokenizer=tok,
    )
    ids = {
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    cfg = ColPaliConfig(embedding_dim=DIM, vlm_config={
        "model_type": "paligemma", "image_token_id": proc.image_token_id, "projection_dim": 32, **ids,
        "text_config": {"model_type": "gemma", **TEXT, **ids},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                          "projection_dim": 32},
    })  # fmt: skip
    torch.manual_seed(0)
    ColPaliForRetrieval(cfg).eval().save_pretrained(str(path))
    proc.save_pretrained(str(path))
    return path


def build_colqwen2(path: Path) -> Path:
    tok = qwen2_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )
    proc = ColQwen2Processor(image_processor=image_processor, tokenizer=tok)
    ids = {
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": tok.eos_token_id,
    }
    cfg = ColQwen2Config(embedding_dim=DIM, vlm_config={
        "model_type": "qwen2_vl", "image_token_id": proc.image_token_id,
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"), **ids,
        "text_config": {"model_type": "qwen2_vl_text", **TEXT, **ids,
                        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                          "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2},
    })  # fmt: skip
    torch.manual_seed(0)
    ColQwen2ForRetrieval(cfg).eval().save_pretrained(str(path))
    proc.save_pretrained(str(path))
    return path
