"""Comparing embeddings where the worker may compute in bfloat16 (SIE_CPU_PRECISION=auto on a CPU
with native bf16): the same text in batches of other shapes, or against a float32 reference, agrees
in direction, not bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np

#: two bf16 computations of the same text (another batch, packed vs padded): MiniLM agrees >= 0.99995
SAME_BF16 = 0.9999
#: a bf16 computation against a float32 reference: MiniLM agrees >= 0.9998 (the load gate asks 0.99)
BF16_VS_FP32 = 0.999


def cosines(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two vectors or two stacks of them."""
    a, b = np.atleast_2d(np.asarray(a, dtype=np.float64)), np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def assert_same_direction(got: Any, want: Any, min_cosine: float = SAME_BF16) -> None:
    cos = cosines(got, want)
    assert cos.min() >= min_cosine, (
        f"min cosine {cos.min():.6f} < {min_cosine} (rows {cos.round(6).tolist()})"
    )
