"""MUVERA: a fixed-dimensional encoding (FDE) of a multi-vector embedding (Dhulipala et al., 2024).

Each of ``num_repetitions`` repetitions draws ``num_simhash_projections`` Gaussian hyperplanes;
the signs of a token against them pick one of ``2**k`` buckets (Gray-code order, so buckets
whose ids differ in one bit are neighbours). Tokens are optionally projected to
``projection_dim`` with a random ±1 (AMS) sketch, then **summed** per bucket for queries and
**averaged** per bucket for documents; empty document buckets take the nearest token (Hamming
distance of the sign pattern) when ``fill_empty_partitions`` is on. The blocks of all
repetitions are concatenated (length ``R · 2**k · projection_dim``), optionally followed by a
count-sketch ``final_projection_dim``. The dot product of a query FDE with a document FDE
approximates the Chamfer (MaxSim) similarity of the multi-vectors.

Configuration (:class:`protocol.params.MuveraConfig`, checked where the request is) comes from the
profile's load-time ``muvera_config`` overlaid with the request's ``options["muvera"]`` map; the
random matrices depend only on (seed, token dim, config).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from protocol.params import MuveraConfig


def gray_bucket(bits: np.ndarray) -> np.ndarray:
    """Sign bits (n, k) → bucket ids (n,): append each bit to a Gray code, most significant first."""
    idx = np.zeros(bits.shape[0], dtype=np.int64)
    for j in range(bits.shape[1]):
        idx = (idx << 1) + (bits[:, j].astype(np.int64) ^ (idx & 1))
    return idx


@lru_cache(maxsize=64)
def _bucket_bit_patterns(k: int) -> np.ndarray:
    """(2**k, k) sign pattern of every bucket id (the inverse of ``gray_bucket``)."""
    all_bits = ((np.arange(1 << k)[:, None] >> np.arange(k - 1, -1, -1)[None, :]) & 1).astype(bool)
    patterns = np.zeros_like(all_bits)
    patterns[gray_bucket(all_bits)] = all_bits
    return patterns


@dataclass(frozen=True)
class Matrices:
    simhash: tuple[np.ndarray, ...]  # per repetition (d, k)
    projection: tuple[np.ndarray | None, ...]  # per repetition (d, d_proj) or None
    final_index: np.ndarray | None  # count sketch target coordinate per FDE coordinate
    final_sign: np.ndarray | None


@lru_cache(maxsize=32)
def matrices(cfg: MuveraConfig, token_dim: int) -> Matrices:
    simhash, projection = [], []
    for rep in range(cfg.num_repetitions):
        rng = np.random.default_rng([cfg.seed, rep])
        simhash.append(rng.standard_normal((token_dim, cfg.num_simhash_projections)).astype(np.float32))
        if cfg.projection_dim:
            signs = rng.integers(0, 2, size=(token_dim, cfg.projection_dim)) * 2 - 1
            projection.append((signs / np.sqrt(cfg.projection_dim)).astype(np.float32))
        else:
            projection.append(None)
    final_index = final_sign = None
    if cfg.final_projection_dim:
        rng = np.random.default_rng([cfg.seed, 1 << 20])
        full = cfg.num_repetitions * cfg.num_buckets * cfg.block_dim(token_dim)
        final_index = rng.integers(0, cfg.final_projection_dim, size=full)
        final_sign = (rng.integers(0, 2, size=full) * 2 - 1).astype(np.float32)
    return Matrices(tuple(simhash), tuple(projection), final_index, final_sign)


def fde(tokens: np.ndarray, cfg: MuveraConfig, *, is_query: bool) -> np.ndarray:
    """One multi-vector (n, d) → its FDE (float32, length ``cfg.output_dim(d)``)."""
    x = np.asarray(tokens, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"a multivector must be 2-D, got shape {x.shape}")
    n, d = x.shape
    mats = matrices(cfg, d)
    buckets, width = cfg.num_buckets, cfg.block_dim(d)
    out = np.zeros((cfg.num_repetitions, buckets, width), dtype=np.float32)
    if n:
        patterns = _bucket_bit_patterns(cfg.num_simhash_projections)
        for rep in range(cfg.num_repetitions):
            bits = (x @ mats.simhash[rep]) > 0
            ids = gray_bucket(bits)
            projection = mats.projection[rep]
            proj = x if projection is None else x @ projection
            block = out[rep]
            np.add.at(block, ids, proj)
            if is_query:
                continue
            counts = np.bincount(ids, minlength=buckets).astype(np.float32)
            filled = counts > 0
            block[filled] /= counts[filled, None]
            if cfg.fill_empty_partitions and not filled.all():
                empty = np.flatnonzero(~filled)
                # Hamming distance between each empty bucket's sign pattern and each token's
                dist = (patterns[empty][:, None, :] != bits[None, :, :]).sum(axis=-1)
                block[empty] = proj[dist.argmin(axis=1)]
    flat = out.reshape(-1)
    if mats.final_index is not None and mats.final_sign is not None and cfg.final_projection_dim:
        final = np.zeros(cfg.final_projection_dim, dtype=np.float32)
        np.add.at(final, mats.final_index, flat * mats.final_sign)
        return final
    return flat


def muvera_outputs(cfg: MuveraConfig, raws: list[dict[str, Any]], *, is_query: bool) -> list[dict[str, Any]]:
    """Postprocessor: add ``dense`` (the FDE) to each raw output that carries a ``multivector``."""
    out = []
    for raw in raws:
        mv = raw.get("multivector")
        raw = dict(raw)
        if mv is not None:
            raw["dense"] = fde(mv, cfg, is_query=is_query)
        out.append(raw)
    return out
