"""The three weight-cache tiers with real directories: source → cluster cache → local disk cache."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from worker.models.weights import (
    LAST_USED,
    MANIFEST,
    Progress,
    Source,
    WeightCache,
    WeightsError,
    cache_key,
    hub_offline,
    progress_line,
)
from worker.settings import WorkerSettings


def make_weights(root: Path, name: str, size: int = 1000) -> Path:
    d = root / name
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"name": name}))
    (d / "model.safetensors").write_bytes(name.encode()[:1] * size)
    (d / "sub" / "tokenizer.json").write_text("{}")
    return d


def files_of(d: Path) -> dict[str, bytes]:
    return {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in d.rglob("*")
        if p.is_file() and p.name not in (LAST_USED, MANIFEST)
    }


def test_cache_key_is_a_safe_name():
    assert cache_key("org/model") == "org--model--main"
    assert cache_key("org/model", "v1.2") == "org--model--v1.2"
    assert "/" not in cache_key("a/b c:d", "x/y")


def test_source_directory_is_published_then_a_second_worker_reads_the_cluster_cache(tmp_path):
    src = make_weights(tmp_path, "src")
    cluster = tmp_path / "cluster"
    first = WeightCache(tmp_path / "disk1", cluster_url=str(cluster), offline=True)
    source = Source(ident="org/model", local_path=str(src))
    assert first.resolve(source) == src  # a local source is used in place
    first.flush()
    entry = cluster / "org--model--main"
    assert (entry / MANIFEST).exists()
    assert files_of(entry) == files_of(src)
    assert not (tmp_path / "disk1").exists() or first.local_entries() == []  # nothing downloaded

    second = WeightCache(tmp_path / "disk2", cluster_url=str(cluster), offline=True)
    got = second.resolve(Source(ident="org/model"))  # no source of its own
    assert got == tmp_path / "disk2" / "org--model--main"
    assert files_of(got) == files_of(src)
    assert second.local_entries() == ["org--model--main"]

    # the local disk cache is the first tier: found even with no cluster cache configured
    third = WeightCache(tmp_path / "disk2", offline=True)
    assert third.resolve(Source(ident="org/model")) == got


def test_publish_skips_an_entry_already_in_the_cluster(tmp_path):
    cluster = tmp_path / "cluster"
    a = WeightCache(tmp_path / "d", cluster_url=f"file://{cluster}", offline=True)  # file:// URL works too
    src = make_weights(tmp_path, "src")
    a.resolve(Source(ident="m", local_path=str(src)))
    a.flush()
    manifest = (cluster / "m--main" / MANIFEST).read_bytes()
    other = make_weights(tmp_path, "other")
    a.resolve(Source(ident="m", local_path=str(other)))
    a.flush()
    assert (cluster / "m--main" / MANIFEST).read_bytes() == manifest
    assert files_of(cluster / "m--main") == files_of(src)


def test_an_entry_without_manifest_is_incomplete_and_ignored(tmp_path):
    cluster = tmp_path / "cluster"
    make_weights(cluster, "m--main")  # files, but the uploader never finished
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    with pytest.raises(WeightsError, match="not in the local disk cache or the cluster cache"):
        cache.resolve(Source(ident="m"))


def test_packaged_fallback_when_the_hub_is_offline_and_it_is_published(tmp_path):
    fallback = make_weights(tmp_path, "pkg")
    cluster = tmp_path / "cluster"
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    source = Source(
        ident="no-such-org/no-such-model", hub_id="no-such-org/no-such-model", fallback=str(fallback)
    )
    assert cache.resolve(source) == fallback
    cache.flush()
    assert files_of(cluster / "no-such-org--no-such-model--main") == files_of(fallback)


def test_offline_mode_never_fetches_from_the_hub(tmp_path, monkeypatch):
    cache = WeightCache(tmp_path / "d", offline=True)
    with pytest.raises(WeightsError) as err:
        cache.resolve(Source(ident="no-such-org/x", hub_id="no-such-org/x"))
    assert err.value.error_class == "NETWORK"
    assert "not cached" in str(err.value)
    assert cache.local_entries() == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_offline(False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub_offline(False)


def seed_cluster(cluster: Path, *names: str, size: int = 1000) -> None:
    for name in names:
        src = make_weights(cluster.parent / "seed", name, size)
        seeder = WeightCache(cluster.parent / "seed-disk", cluster_url=str(cluster))
        seeder.resolve(Source(ident=name, local_path=str(src)))
        seeder.flush()


def test_disk_cache_lru_eviction_over_a_synthetic_budget(tmp_path):
    cluster = tmp_path / "cluster"
    seed_cluster(cluster, "a", "b", "c")
    # each entry is ~1030 bytes; budget 2500 at 85 % → at most two entries fit
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), disk_budget_bytes=2500, offline=True)
    cache.resolve(Source(ident="a"))
    cache.resolve(Source(ident="b"))
    assert cache.local_entries() == ["a--main", "b--main"]
    cache.resolve(Source(ident="a"))  # a local hit makes "a" the most recently used
    assert cache.local_entries() == ["b--main", "a--main"]
    cache.resolve(Source(ident="c"))
    assert cache.evicted == ["b--main"]
    assert cache.local_entries() == ["a--main", "c--main"]
    used, total = cache.disk_usage()
    assert total == 2500 and used * 100 / total <= 85


def test_disk_eviction_spares_protected_entries(tmp_path):
    cluster = tmp_path / "cluster"
    seed_cluster(cluster, "a", "b", "c")
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), disk_budget_bytes=2500, offline=True)
    cache.resolve(Source(ident="a"))
    cache.resolve(Source(ident="b"))
    cache.resolve(Source(ident="c"), protect={"a--main"})  # a model using "a" is loaded
    assert cache.local_entries() == ["a--main", "c--main"]
    assert cache.evicted == ["b--main"]


@pytest.mark.parametrize("threshold,kept", [(100.0, 3), (85.0, 2), (50.0, 1)])
def test_disk_pressure_threshold_setting(tmp_path, threshold, kept):
    cluster = tmp_path / "cluster"
    seed_cluster(cluster, "a", "b", "c")
    cache = WeightCache(
        tmp_path / "d",
        cluster_url=str(cluster),
        disk_budget_bytes=3200,
        offline=True,
        disk_threshold_percent=threshold,
    )
    for name in "abc":
        cache.resolve(Source(ident=name))
    assert len(cache.local_entries()) == kept
    assert cache.local_entries()[-1] == "c--main"  # the newest entry is never the one evicted


def test_real_disk_usage_without_a_budget(tmp_path):
    used, total = WeightCache(tmp_path / "d").disk_usage()
    assert 0 < used <= total


def test_progress_is_logged_while_a_download_runs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker.models.weights")
    target = tmp_path / "dl"
    target.mkdir()
    (target / "part").write_bytes(b"x" * 2_000_000)
    with Progress("org/model", target, interval_s=0.01, total=4_000_000) as progress:
        while not progress.reports:
            time.sleep(0.01)
    assert progress.reports[0] == 2_000_000
    text = caplog.text
    assert "downloading org/model (4.0 MB)" in text
    assert "downloading org/model: 50% [##########----------] 2.0 MB of 4.0 MB, " in text
    assert "downloaded org/model: 2.0 MB" in text


def test_progress_line_draws_a_bar_when_the_total_is_known():
    assert (
        progress_line(1_000_000, 4_000_000, 2.0)
        == "25% [#####---------------] 1.0 MB of 4.0 MB, 0.5 MB/s, 6 s left"
    )
    assert progress_line(5_000_000, 4_000_000, 1.0).startswith("100% [####################] 5.0 MB of 4.0 MB")
    assert progress_line(3_000_000, None, 1.5) == "3.0 MB, 2.0 MB/s"


def test_cluster_download_logs_progress(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker.models.weights")
    cluster = tmp_path / "cluster"
    seed_cluster(cluster, "a")
    WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True).resolve(Source(ident="a"))
    assert f"downloading a--main from {cluster}" in caplog.text
    assert "downloaded a--main from" in caplog.text


def test_settings_reach_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SIE_DISK_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("SIE_DISK_PRESSURE_THRESHOLD_PERCENT", "70")
    monkeypatch.setenv("SIE_DISK_BUDGET_BYTES", "12345")
    monkeypatch.setenv("SIE_CLUSTER_CACHE_URL", str(tmp_path / "cluster"))
    monkeypatch.setenv("SIE_DOWNLOAD_PROGRESS_INTERVAL_S", "2.5")
    monkeypatch.setenv("SIE_HF_OFFLINE", "1")
    cache = WeightCache.from_settings(WorkerSettings())
    assert cache.disk_dir == tmp_path / "c"
    assert cache.disk_threshold_percent == 70
    assert cache.disk_budget_bytes == 12345
    assert cache.cluster is not None and cache.cluster.root == str(tmp_path / "cluster")
    assert cache.progress_interval_s == 2.5
    assert cache.offline is True


def test_lifecycle_setting_defaults(monkeypatch):
    for name in (
        "MEMORY_PRESSURE_THRESHOLD_PERCENT",
        "MEMORY_BUDGET_BYTES",
        "MEMORY_MONITOR_INTERVAL_S",
        "MAX_LORAS_PER_MODEL",
        "LORA_LOADING_RETRY_AFTER_S",
        "DISK_CACHE_DIR",
        "DISK_PRESSURE_THRESHOLD_PERCENT",
        "DISK_BUDGET_BYTES",
        "CLUSTER_CACHE_URL",
        "DOWNLOAD_PROGRESS_INTERVAL_S",
    ):
        monkeypatch.delenv(f"SIE_{name}", raising=False)
    s = WorkerSettings()
    assert s.memory_pressure_threshold_percent == 85
    assert s.memory_budget_bytes == 0
    assert s.memory_monitor_interval_s == 1.0
    assert s.max_loras_per_model == 10
    assert s.lora_loading_retry_after_s == 1.0
    assert s.disk_cache_dir == "~/.cache/sie/weights"
    assert s.disk_pressure_threshold_percent == 85
    assert s.disk_budget_bytes == 0
    assert s.cluster_cache_url == ""
    assert s.download_progress_interval_s == 10.0


@pytest.mark.parametrize(
    "name,value",
    [
        ("MEMORY_PRESSURE_THRESHOLD_PERCENT", "0"),
        ("MEMORY_PRESSURE_THRESHOLD_PERCENT", "101"),
        ("MAX_LORAS_PER_MODEL", "0"),
        ("MEMORY_BUDGET_BYTES", "-1"),
        ("DISK_PRESSURE_THRESHOLD_PERCENT", "0"),
        ("DOWNLOAD_PROGRESS_INTERVAL_S", "0"),
    ],
)
def test_settings_out_of_range_are_refused(monkeypatch, name, value):
    monkeypatch.setenv(f"SIE_{name}", value)
    with pytest.raises(ValueError):
        WorkerSettings()
