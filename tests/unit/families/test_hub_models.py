"""The default catalog's hub models of each family: without a reachable hub they fail to load with
a clear MODEL_LOAD_FAILED; on CUDA (marked gpu) the flash-attn / SDPA path equals fp32 SDPA."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.errors import ErrorCode, SIEError
from tests.support.typed import inputs as typed_inputs
from tests.unit.families.conftest import RuntimeThread
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR


def hub_models() -> list[tuple[str, str]]:
    """(operation, model) of every catalog model whose weights come only from the hub."""
    from protocol.catalog import Catalog

    out = []
    for m in Catalog.from_dirs(DEFAULT_MODELS_DIR, DEFAULT_BUNDLES_DIR).models():
        if not m.hf_id or m.weights_path or m.weights_fallback or m.package_backed:
            continue
        op = "encode" if m.tasks.encode is not None else "score" if m.tasks.score is not None else "extract"
        profile = (
            "dense" if "dense" in m.profiles and op == "encode" and "multivector" in m.profiles else None
        )
        out.append((op, f"{m.sie_id}:{profile}" if profile else m.sie_id))
    return out


def first_output(model: str) -> str:
    from protocol.catalog import Catalog

    encode = Catalog.from_dirs(DEFAULT_MODELS_DIR, DEFAULT_BUNDLES_DIR).resolve(model).config.tasks.encode
    return next(t for t in ("dense", "sparse", "multivector") if getattr(encode, t, None) is not None)


HUB_MODELS = hub_models()


def test_the_catalog_covers_every_family():
    ids = {m for _, m in HUB_MODELS}
    for expected in (
        "BAAI/bge-reranker-v2-m3",
        "urchade/gliner_multi-v2.1",
        "Qwen/Qwen3-Embedding-0.6B",
        "Qwen/Qwen3-Reranker-0.6B",
        "naver/splade-v3",
        "colbert-ir/colbertv2.0",
        "BAAI/bge-m3:dense",
        "answerdotai/answerai-colbert-small-v1",
    ):
        assert expected in ids
    assert len(HUB_MODELS) >= 30


@pytest.fixture(scope="module")
def hub_runtime(tmp_path_factory):
    from worker.settings import WorkerSettings

    settings = WorkerSettings(
        models_dir=str(DEFAULT_MODELS_DIR),
        bundles_dir=str(DEFAULT_BUNDLES_DIR),
        device="cpu",
        hf_offline=True,
        memory_monitor_interval_s=0,
        disk_cache_dir=str(tmp_path_factory.mktemp("empty-cache")),
    )
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
            hub_runtime.call("encode", model, [{"text": "x"}], {"output_types": [first_output(model)]})
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
    for model_id, cls, ctx, examples in (
        ("local/colbert", ColBERTAdapter, RequestContext(op="encode", output_types=("multivector",)), texts),
        (
            "local/reranker",
            CrossEncoderAdapter,
            RequestContext(op="score"),
            [({"text": "q"}, t) for t in texts],
        ),
    ):
        outs = []
        for device, precision in (("cpu", "float32"), ("cuda", "bfloat16")):
            r = catalog.resolve(model_id)
            weights = {
                "local/colbert": family_checkpoints["colbert"],
                "local/reranker": family_checkpoints["cross_encoder"],
            }[model_id]
            adapter = cls(LoadSpec(r.config, "default", str(weights), device, precision))
            adapter.load()
            outs.append(adapter.forward(ctx, adapter.prepare(ctx, typed_inputs(examples))))
        for a, b in zip(*outs, strict=True):
            if isinstance(a, float):
                assert b == pytest.approx(a, rel=0.02, abs=0.02)
            else:
                x, y = a["multivector"], b["multivector"]
                cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
                assert cos.min() >= 0.99
