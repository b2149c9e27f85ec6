"""The default catalog's hub models of each family: without a reachable hub they fail to load with
a clear MODEL_LOAD_FAILED; on CUDA (marked gpu) the flash-attn / SDPA path equals fp32 SDPA."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.errors import ErrorCode, SIEError
from tests.unit.families.conftest import RuntimeThread
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR

HUB_MODELS = [
    ("score", "cross-encoder/ms-marco-MiniLM-L-6-v2"),
    ("encode", "answerdotai/answerai-colbert-small-v1:muvera"),
    ("encode", "BAAI/bge-m3:dense"),
    ("extract", "urchade/gliner_small-v2.1"),
]


@pytest.fixture(scope="module")
def hub_runtime(tmp_path_factory):
    from worker.settings import WorkerSettings

    settings = WorkerSettings(models_dir=str(DEFAULT_MODELS_DIR), bundles_dir=str(DEFAULT_BUNDLES_DIR), device="cpu",
                              hf_offline=True, memory_monitor_interval_s=0,
                              disk_cache_dir=str(tmp_path_factory.mktemp("empty-cache")))
    rt = RuntimeThread(settings)
    yield rt
    rt.close()


@pytest.mark.parametrize(("op", "model"), HUB_MODELS)
def test_hub_model_without_hub_fails_with_model_load_failed(hub_runtime, op, model):
    with pytest.raises(SIEError) as err:
        if op == "score":
            hub_runtime.call("score", model, {"text": "q"}, [{"text": "d"}])
        elif op == "extract":
            hub_runtime.call("extract", model, [{"text": "Apple"}], {"labels": ["organization"]})
        else:
            hub_runtime.call("encode", model, [{"text": "x"}], {"output_types": ["dense"]})
    assert err.value.code == ErrorCode.MODEL_LOAD_FAILED
    assert model.split(":")[0] in err.value.message and err.value.extra.get("attempts", 0) >= 1


@pytest.mark.gpu
def test_cuda_half_precision_path_matches_fp32(family_checkpoints):
    """bf16 weights with flash-attn varlen (when installed) or SDPA on CUDA vs fp32 SDPA on CPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from protocol.catalog import Catalog
    from worker.adapters.base import LoadSpec, RequestContext
    from worker.adapters.colbert import ColBERTAdapter
    from worker.adapters.cross_encoder import CrossEncoderAdapter
    from worker.adapters.hf import attn_implementation

    catalog = Catalog.from_dirs(family_checkpoints["models_dir"], DEFAULT_BUNDLES_DIR)
    try:
        import flash_attn  # noqa: F401

        assert attn_implementation("cuda") == "flash_attention_2"
    except ImportError:
        assert attn_implementation("cuda") == "sdpa"
    texts = [{"text": "short"}, {"text": "a somewhat longer document about late interaction " * 5}]
    for model_id, cls, ctx, inputs in (
        ("local/colbert", ColBERTAdapter, RequestContext(op="encode", output_types=("multivector",)), texts),
        ("local/reranker", CrossEncoderAdapter, RequestContext(op="score"), [({"text": "q"}, t) for t in texts]),
    ):
        outs = []
        for device, precision in (("cpu", "float32"), ("cuda", "bfloat16")):
            r = catalog.resolve(model_id)
            weights = {"local/colbert": family_checkpoints["colbert"],
                       "local/reranker": family_checkpoints["cross_encoder"]}[model_id]
            adapter = cls(LoadSpec(r.config, "default", str(weights), device, precision))
            adapter.load()
            outs.append(adapter.forward(ctx, adapter.prepare(ctx, inputs)))
        for a, b in zip(*outs, strict=True):
            if isinstance(a, float):
                assert b == pytest.approx(a, rel=0.02, abs=0.02)
            else:
                x, y = a["multivector"], b["multivector"]
                cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
                assert cos.min() >= 0.99
