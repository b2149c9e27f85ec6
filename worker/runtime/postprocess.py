"""Postprocessing of raw float32 outputs: quantisation and the per-item wire shape."""

from __future__ import annotations

from typing import Any

import numpy as np

from protocol.errors import invalid_input


def quantize_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """Quantise a vector (1-D) or each row of a matrix (2-D) independently."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "int8":
        scale = np.max(np.abs(x), axis=-1, keepdims=True)
        safe = np.where(scale == 0, 1.0, scale)
        q = np.rint(x / safe * 127.0)
        return np.clip(q, -127, 127).astype(np.int8)
    if dtype == "uint8":
        lo = np.min(x, axis=-1, keepdims=True)
        hi = np.max(x, axis=-1, keepdims=True)
        span = hi - lo
        scaled = np.where(span == 0, 128.0, np.rint((x - lo) / np.where(span == 0, 1.0, span) * 255.0))
        return np.clip(scaled, 0, 255).astype(np.uint8)
    if dtype in ("binary", "ubinary"):
        return np.packbits(x > 0, axis=-1)
    raise invalid_input(f"unknown output_dtype {dtype!r}", param="output_dtype")


def wire_dtype(dtype: str) -> str:
    return "binary" if dtype == "ubinary" else dtype


def matryoshka(raws: list[dict[str, Any]], dim: int, normalize: bool) -> list[dict[str, Any]]:
    """Keep the first ``dim`` dense components (Matryoshka-trained models put the most
    information first) and re-normalise, so cosine and dot product stay what they were."""
    out = []
    for raw in raws:
        dense = raw.get("dense")
        if dense is not None:
            dense = np.asarray(dense, dtype=np.float32)[..., :dim]
            if normalize:
                dense = dense / max(float(np.linalg.norm(dense)), 1e-12)
            raw = {**raw, "dense": dense}
        out.append(raw)
    return out


def encode_item(raw: dict[str, Any], dtype: str, dims: dict[str, int], item_id: str | None) -> dict[str, Any]:
    """Raw adapter output → one encode response item with quantised arrays."""
    out: dict[str, Any] = {}
    if item_id is not None:
        out["id"] = item_id
    dense = raw.get("dense")
    if dense is not None:
        out["dense"] = {
            "dims": dims.get("dense") or int(dense.shape[-1]),
            "dtype": wire_dtype(dtype),
            "values": quantize_rows(dense, dtype),
        }
    sparse = raw.get("sparse")
    if sparse is not None:
        indices, values = sparse
        order = np.argsort(indices, kind="stable")
        values = np.asarray(values, dtype=np.float32)[order]
        out["sparse"] = {
            "dims": dims.get("sparse"),
            "dtype": "float16" if dtype == "float16" else "float32",
            "indices": np.asarray(indices, dtype=np.int32)[order],
            "values": values.astype(np.float16) if dtype == "float16" else values,
        }
    mv = raw.get("multivector")
    if mv is not None:
        out["multivector"] = {
            "token_dims": dims.get("multivector") or int(mv.shape[-1]),
            "num_tokens": int(mv.shape[0]),
            "dtype": wire_dtype(dtype),
            "values": quantize_rows(mv, dtype),
        }
    return out
