"""MUVERA fixed-dimensional encodings: exact properties, checked against a naive re-computation."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.errors import SIEError
from worker.runtime.muvera import MuveraConfig, fde, matrices

CFG = MuveraConfig(num_repetitions=3, num_simhash_projections=3, projection_dim=None, seed=7)


def _tokens(n: int, d: int = 16, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _naive_bucket(bits: list[bool]) -> int:
    code = 0
    for b in bits:
        code = (code << 1) + (int(b) ^ (code & 1))
    return code


def _naive(x: np.ndarray, cfg: MuveraConfig, is_query: bool) -> np.ndarray:
    """Token-by-token loops over the same random matrices."""
    mats = matrices(cfg, x.shape[1])
    blocks = []
    for rep in range(cfg.num_repetitions):
        proj = x if mats.projection[rep] is None else x @ mats.projection[rep]
        members: dict[int, list[int]] = {}
        sign_bits = []
        for t in range(x.shape[0]):
            bits = [float(x[t] @ mats.simhash[rep][:, j]) > 0 for j in range(cfg.num_simhash_projections)]
            sign_bits.append(bits)
            members.setdefault(_naive_bucket(bits), []).append(t)
        block = np.zeros((cfg.num_buckets, proj.shape[1]), dtype=np.float64)
        for b in range(cfg.num_buckets):
            rows = members.get(b, [])
            if rows:
                s = proj[rows].astype(np.float64).sum(axis=0)
                block[b] = s if is_query else s / len(rows)
            elif not is_query and cfg.fill_empty_partitions:
                # the bucket's sign pattern: the bits whose Gray bucket is b
                pattern = next(
                    [
                        bool(v >> (cfg.num_simhash_projections - 1 - j) & 1)
                        for j in range(cfg.num_simhash_projections)
                    ]
                    for v in range(cfg.num_buckets)
                    if _naive_bucket(
                        [
                            bool(v >> (cfg.num_simhash_projections - 1 - j) & 1)
                            for j in range(cfg.num_simhash_projections)
                        ]
                    )
                    == b
                )
                dists = [sum(p != q for p, q in zip(pattern, sb, strict=True)) for sb in sign_bits]
                block[b] = proj[int(np.argmin(dists))]
        blocks.append(block.reshape(-1))
    return np.concatenate(blocks)


@pytest.mark.parametrize("n", [1, 2, 7, 40, 300])
def test_fixed_length_for_any_token_count(n):
    cfg = MuveraConfig()
    for is_query in (True, False):
        out = fde(_tokens(n, 96), cfg, is_query=is_query)
        assert out.shape == (20 * 32 * 16,) == (cfg.output_dim(96),)
        assert out.dtype == np.float32
    final = MuveraConfig(final_projection_dim=1000)
    assert fde(_tokens(n, 96), final, is_query=False).shape == (1000,)


def test_deterministic_for_a_seed_and_different_across_seeds():
    x = _tokens(12)
    a = fde(x, CFG, is_query=False)
    matrices.cache_clear()
    b = fde(x, CFG, is_query=False)
    np.testing.assert_array_equal(a, b)
    other = MuveraConfig(num_repetitions=3, num_simhash_projections=3, projection_dim=None, seed=8)
    assert not np.array_equal(a, fde(x, other, is_query=False))


@pytest.mark.parametrize("projection_dim", [None, 4])
@pytest.mark.parametrize("fill", [True, False])
def test_query_sums_and_document_averages_per_bucket(projection_dim, fill):
    cfg = MuveraConfig(
        num_repetitions=4,
        num_simhash_projections=3,
        projection_dim=projection_dim,
        fill_empty_partitions=fill,
        seed=3,
    )
    x = _tokens(9)
    for is_query in (True, False):
        np.testing.assert_allclose(
            fde(x, cfg, is_query=is_query), _naive(x, cfg, is_query), rtol=1e-5, atol=1e-6
        )


def test_query_is_linear():
    q1, q2 = _tokens(5, seed=1), _tokens(8, seed=2)
    both = fde(np.concatenate([q1, q2]), CFG, is_query=True)
    np.testing.assert_allclose(
        both, fde(q1, CFG, is_query=True) + fde(q2, CFG, is_query=True), rtol=1e-5, atol=1e-6
    )
    # positive scaling keeps every bucket, so the encoding scales with it
    np.testing.assert_allclose(
        fde(2.5 * q1, CFG, is_query=True), 2.5 * fde(q1, CFG, is_query=True), rtol=1e-5
    )


def test_document_average_ignores_duplication():
    d = _tokens(6)
    np.testing.assert_allclose(
        fde(np.concatenate([d, d, d]), CFG, is_query=False), fde(d, CFG, is_query=False), rtol=1e-5, atol=1e-6
    )


def test_inner_product_is_bucketwise_sum_dot_average():
    """<FDE(q), FDE(d)> = Σ_rep Σ_bucket (Σ q in bucket) · (mean d in bucket), without projection."""
    cfg = MuveraConfig(
        num_repetitions=2, num_simhash_projections=2, projection_dim=None, fill_empty_partitions=False, seed=5
    )
    q, d = _tokens(4, seed=11), _tokens(10, seed=12)
    mats = matrices(cfg, q.shape[1])
    expected = 0.0
    for rep in range(cfg.num_repetitions):
        qb = [_naive_bucket(list(row > 0)) for row in q @ mats.simhash[rep]]
        db = [_naive_bucket(list(row > 0)) for row in d @ mats.simhash[rep]]
        for b in range(cfg.num_buckets):
            qs = [q[i] for i in range(len(q)) if qb[i] == b]
            ds = [d[i] for i in range(len(d)) if db[i] == b]
            if qs and ds:
                expected += float(np.sum(qs, axis=0) @ np.mean(ds, axis=0))
    got = float(fde(q, cfg, is_query=True) @ fde(d, cfg, is_query=False))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_final_projection_is_a_count_sketch_of_the_full_encoding():
    cfg = MuveraConfig(num_repetitions=2, num_simhash_projections=2, projection_dim=None, seed=1)
    sketch = MuveraConfig(
        num_repetitions=2, num_simhash_projections=2, projection_dim=None, seed=1, final_projection_dim=50
    )
    x = _tokens(7)
    full = fde(x, cfg, is_query=True)
    mats = matrices(sketch, x.shape[1])
    expected = np.zeros(50)
    for i, v in enumerate(full):
        expected[mats.final_index[i]] += mats.final_sign[i] * v
    np.testing.assert_allclose(fde(x, sketch, is_query=True), expected, rtol=1e-5, atol=1e-6)


def test_config_merging_and_validation():
    cfg = MuveraConfig.from_options({"num_repetitions": 4, "seed": 1}, {"seed": 9}, None)
    assert (cfg.num_repetitions, cfg.seed, cfg.num_simhash_projections) == (4, 9, 5)
    assert MuveraConfig.from_options(None, {}) == MuveraConfig()
    for bad in ({"num_repetitions": 0}, {"nope": 1}, {"num_simhash_projections": 40}, "x"):
        with pytest.raises(SIEError):
            MuveraConfig.from_options(bad)
