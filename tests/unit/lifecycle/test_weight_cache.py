"""The three weight-cache tiers with real directories: source → cluster cache → local disk cache."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import pytest

from worker.models import weights
from worker.models.weights import (
    LAST_USED,
    MANIFEST,
    MANIFEST_VERSION,
    ClusterCache,
    IntegrityError,
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


def two_of_three_on_a_budget(tmp_path) -> WeightCache:
    """An offline cache of a 2,500-byte disk budget over a cluster cache of ``a``, ``b`` and ``c``,
    with ``a`` then ``b`` resolved: each entry is ~1030 bytes, and at 85 % at most two fit."""
    cluster = tmp_path / "cluster"
    seed_cluster(cluster, "a", "b", "c")
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), disk_budget_bytes=2500, offline=True)
    cache.resolve(Source(ident="a"))
    cache.resolve(Source(ident="b"))
    return cache


def test_disk_cache_lru_eviction_over_a_synthetic_budget(tmp_path):
    cache = two_of_three_on_a_budget(tmp_path)
    assert cache.local_entries() == ["a--main", "b--main"]
    cache.resolve(Source(ident="a"))  # a local hit makes "a" the most recently used
    assert cache.local_entries() == ["b--main", "a--main"]
    cache.resolve(Source(ident="c"))
    assert cache.evicted == ["b--main"]
    assert cache.local_entries() == ["a--main", "c--main"]
    used, total = cache.disk_usage()
    assert total == 2500 and used * 100 / total <= 85


def test_disk_eviction_spares_protected_entries(tmp_path):
    cache = two_of_three_on_a_budget(tmp_path)
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


# ---- integrity of the cluster cache: sha256 per file in the manifest -------------------------
def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def publish_entry(tmp_path: Path, name: str = "m", size: int = 1000) -> tuple[Path, Path]:
    """A source directory published to a cluster cache: (source, cluster root)."""
    src = make_weights(tmp_path / "sources", name, size)
    cluster = tmp_path / "cluster"
    seeder = WeightCache(tmp_path / "seed-disk", cluster_url=str(cluster), offline=True)
    seeder.resolve(Source(ident=name, local_path=str(src)))
    seeder.flush()
    return src, cluster


def leftovers(disk: Path) -> list[str]:
    """Every file under the local disk cache (entries and temporary directories alike)."""
    return (
        sorted(p.relative_to(disk).as_posix() for p in disk.rglob("*") if p.is_file())
        if disk.exists()
        else []
    )


def test_the_manifest_holds_size_and_sha256_of_every_file(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_CHUNK", 7)  # a file streams through the hash in many reads
    src, cluster = publish_entry(tmp_path)
    doc = json.loads((cluster / "m--main" / MANIFEST).read_text())
    assert doc["version"] == MANIFEST_VERSION == 2
    assert doc["files"] == {
        rel: {"size": (src / rel).stat().st_size, "sha256": sha256_of(src / rel)}
        for rel in ("config.json", "model.safetensors", "sub/tokenizer.json")
    }
    assert ClusterCache(str(cluster)).keys() == frozenset({"m--main"})


def test_a_fetch_checks_every_file_then_fills_the_local_cache(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker.models.weights")
    src, cluster = publish_entry(tmp_path)
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    got = cache.resolve(Source(ident="m"))
    assert files_of(got) == files_of(src)
    assert "m: weights from the cluster cache" in caplog.text and "(sha256 checked)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def poison(cluster: Path, rel: str = "model.safetensors", entry: str = "m--main") -> bytes:
    """Change a published file's bytes, keeping its size (what a bucket writer would do)."""
    path = cluster / entry / rel
    good = path.read_bytes()
    path.write_bytes(b"E" * len(good))
    assert len(path.read_bytes()) == len(good) and path.read_bytes() != good
    return good


def test_a_file_altered_in_the_bucket_is_refused_and_the_fallback_serves_then_heals(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker.models.weights")
    src, cluster = publish_entry(tmp_path)
    poison(cluster)
    disk = tmp_path / "d"
    cache = WeightCache(disk, cluster_url=str(cluster), offline=True)
    got = cache.resolve(Source(ident="m", hub_id="no-such-org/m", fallback=str(src)))
    assert got == src  # the next tiers: the hub (offline, fails), then the packaged fallback
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # the first copy, then the one re-fetch
    assert "cluster cache entry m--main: file 'model.safetensors' does not match its manifest" in warnings[0]
    assert "(sha256 differs)" in warnings[0] and "fetching it again" in warnings[0]
    assert "skipping the cluster cache for this load" in warnings[1]
    assert cache.local_entries() == []
    assert leftovers(disk) == []  # no poisoned byte stayed on the disk, not even in a temporary dir

    cache.flush()  # the bad entry was published again from the weights that loaded
    assert files_of(cluster / "m--main") == files_of(src)
    fresh = WeightCache(tmp_path / "d2", cluster_url=str(cluster), offline=True)
    assert files_of(fresh.resolve(Source(ident="m"))) == files_of(src)


def test_a_file_altered_with_no_other_tier_fails_the_load_as_integrity(tmp_path):
    _, cluster = publish_entry(tmp_path)
    poison(cluster, "sub/tokenizer.json")
    disk = tmp_path / "d"
    cache = WeightCache(disk, cluster_url=str(cluster), offline=True)
    with pytest.raises(WeightsError) as err:
        cache.resolve(Source(ident="m"))
    assert isinstance(err.value, IntegrityError)
    assert err.value.error_class == "INTEGRITY" and err.value.permanent is False
    assert "sub/tokenizer.json" in str(err.value)
    assert leftovers(disk) == []
    cache.flush()
    assert (cluster / "m--main" / "sub" / "tokenizer.json").read_bytes() == b"EE"  # nothing to heal it with


def test_integrity_wins_the_error_class_when_the_hub_fails_too(tmp_path):
    _, cluster = publish_entry(tmp_path)
    poison(cluster)
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    with pytest.raises(WeightsError) as err:
        cache.resolve(Source(ident="m", hub_id="no-such-org/m"))
    assert err.value.error_class == "INTEGRITY"
    assert "does not match its manifest" in str(err.value) and "not cached" in str(err.value)


def test_a_file_of_another_size_is_refused_without_reading_past_it(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_CHUNK", 100)
    _, cluster = publish_entry(tmp_path)
    (cluster / "m--main" / "model.safetensors").write_bytes(b"m" * 1_000_000)  # same prefix, far longer
    disk = tmp_path / "d"
    cache = WeightCache(disk, cluster_url=str(cluster), offline=True)
    copied: list[int] = []
    real = weights._copy_hashing

    def counting(src, dst, limit=None):
        size, sha = real(src, dst, limit)
        copied.append(size)
        return size, sha

    monkeypatch.setattr(weights, "_copy_hashing", counting)
    with pytest.raises(IntegrityError, match=r"size 1100 != 1000"):
        cache.resolve(Source(ident="m"))
    assert max(copied) == 1100  # stopped one chunk past the manifest's size, not at 1 MB
    assert leftovers(disk) == []


class RepublishOnWarning(logging.Handler):
    """Puts the good bytes back when the worker announces its re-fetch: a publisher that finished
    replacing the entry between the two copies."""

    def __init__(self, path: Path, good: bytes) -> None:
        super().__init__(logging.WARNING)
        self.path, self.good = path, good

    def emit(self, record: logging.LogRecord) -> None:
        if "fetching it again" in record.getMessage():
            self.path.write_bytes(self.good)


def test_a_refused_copy_is_fetched_once_more(tmp_path):
    src, cluster = publish_entry(tmp_path)
    good = poison(cluster)
    handler = RepublishOnWarning(cluster / "m--main" / "model.safetensors", good)
    logger = logging.getLogger("worker.models.weights")
    logger.addHandler(handler)
    try:
        cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
        got = cache.resolve(Source(ident="m"))
    finally:
        logger.removeHandler(handler)
    assert got == tmp_path / "d" / "m--main"
    assert files_of(got) == files_of(src)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["m--main"]  # the refused copy is gone


def write_manifest(cluster: Path, key: str, doc: object) -> None:
    (cluster / key).mkdir(parents=True, exist_ok=True)
    (cluster / key / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "OUTSIDE", "./x", "a//x", "C:x", ".sie-last-used", ""])
def test_a_manifest_naming_a_path_outside_its_entry_is_refused(tmp_path, rel):
    cluster = tmp_path / "cluster"
    disk = tmp_path / "d"
    outside = tmp_path / "outside-x"
    rel = str(outside) if rel == "OUTSIDE" else rel  # an absolute path the test may write
    payload = b"poisoned"
    (cluster / "m--main").mkdir(parents=True)
    for where in (cluster / "m--main" / rel.lstrip("/"), cluster / "x"):  # the bytes, where fsspec would look
        if rel and not where.name.startswith("."):
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    write_manifest(cluster, "m--main", {"version": 2, "files": {rel: {"size": len(payload), "sha256": sha}}})
    cache = WeightCache(disk, cluster_url=str(cluster), offline=True)
    try:
        cache.resolve(Source(ident="m"))
        refused: Exception | None = None
    except Exception as exc:  # noqa: BLE001 - checked below, after what reached the disk
        refused = exc
    assert not outside.exists()
    assert not (disk / "x").exists() and not (tmp_path / "x").exists()
    assert leftovers(disk) == []
    assert isinstance(refused, IntegrityError) and "names an unsafe path" in str(refused)


@pytest.mark.parametrize(
    "doc",
    [
        "not json at all",
        {"version": 2, "files": ["model.safetensors"]},
        {"version": 2, "files": {"model.safetensors": {"size": 8}}},
        {"version": 2, "files": {"model.safetensors": {"size": 8, "sha256": "00"}}},
        {"version": 2, "files": {"model.safetensors": {"size": -1, "sha256": "0" * 64}}},
        {"version": 2, "files": {"model.safetensors": {"size": True, "sha256": "0" * 64}}},
    ],
)
def test_a_malformed_manifest_is_refused_and_replaced(tmp_path, doc):
    src = make_weights(tmp_path, "src")
    cluster = tmp_path / "cluster"
    (cluster / "m--main").mkdir(parents=True)
    (cluster / "m--main" / MANIFEST).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    with pytest.raises(IntegrityError, match="cluster cache entry m--main"):
        cache.resolve(Source(ident="m"))
    assert cache.resolve(Source(ident="m", fallback=str(src))) == src
    cache.flush()
    assert json.loads((cluster / "m--main" / MANIFEST).read_text())["version"] == 2
    assert files_of(cluster / "m--main") == files_of(src)


def test_an_oversized_manifest_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_MANIFEST_MAX_BYTES", 100)
    _, cluster = publish_entry(tmp_path)  # its manifest is ~400 bytes
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    with pytest.raises(IntegrityError, match="its manifest is over"):
        cache.resolve(Source(ident="m"))
    assert cache.local_entries() == []


def seed_v1(cluster: Path, src: Path, key: str = "m--main") -> None:
    """An entry as the cache wrote it before the hashes: the files, and sizes only."""
    files = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src).as_posix()
        (cluster / key / rel).parent.mkdir(parents=True, exist_ok=True)
        (cluster / key / rel).write_bytes(path.read_bytes())
        files[rel] = path.stat().st_size
    write_manifest(cluster, key, {"files": files, "published_at": 0})


def test_a_version_1_manifest_is_not_trusted(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="worker.models.weights")
    src = make_weights(tmp_path, "src")
    cluster = tmp_path / "cluster"
    seed_v1(cluster, src)
    assert ClusterCache(str(cluster)).keys() == frozenset({"m--main"})  # listed: weights_status still sees it
    disk = tmp_path / "d"
    cache = WeightCache(disk, cluster_url=str(cluster), offline=True)
    with pytest.raises(IntegrityError, match=r"manifest \(version 1\) has no sha256"):
        cache.resolve(Source(ident="m"))  # no other tier: the load fails, nothing was copied
    assert leftovers(disk) == []
    assert "skipping the cluster cache for this load" in caplog.text

    assert cache.resolve(Source(ident="m", fallback=str(src))) == src
    cache.flush()  # published again, now with hashes
    doc = json.loads((cluster / "m--main" / MANIFEST).read_text())
    assert doc["version"] == 2
    assert doc["files"]["model.safetensors"]["sha256"] == sha256_of(src / "model.safetensors")
    other = WeightCache(tmp_path / "d2", cluster_url=str(cluster), offline=True)
    assert files_of(other.resolve(Source(ident="m"))) == files_of(src)


def test_a_version_1_entry_is_replaced_by_a_worker_with_a_local_source(tmp_path):
    src = make_weights(tmp_path, "src")
    cluster = tmp_path / "cluster"
    seed_v1(cluster, make_weights(tmp_path, "old"))
    cache = WeightCache(tmp_path / "d", cluster_url=str(cluster), offline=True)
    assert cache.resolve(Source(ident="m", local_path=str(src))) == src
    cache.flush()
    assert json.loads((cluster / "m--main" / MANIFEST).read_text())["version"] == 2
    assert files_of(cluster / "m--main") == files_of(src)
