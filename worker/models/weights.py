"""Where a model's (or a LoRA's) weights come from, through three tiers of cache.

A weights source is a local directory (``weights_path``), a hub id (``hf_id``), or a directory
inside an installed Python package written ``pkg://<package>/<subdir>`` (``weights_fallback``,
used when the hub cannot be reached). Resolution, first hit wins:

1. ``weights_path`` when it exists (already local; used in place);
2. the local disk cache (``SIE_DISK_CACHE_DIR``), entries kept in LRU order and evicted above
   ``SIE_DISK_PRESSURE_THRESHOLD_PERCENT`` of the disk (or of ``SIE_DISK_BUDGET_BYTES``);
3. the cluster cache (``SIE_CLUSTER_CACHE_URL``: a shared directory, ``s3://`` or ``gs://``
   through fsspec), copied into the local disk cache;
4. the Hugging Face hub, downloaded into the local disk cache (offline mode: only the hub's own
   local cache is read, nothing is fetched);
5. the packaged fallback.

Weights found in tiers 1, 4 or 5 are published to the cluster cache (in the background), so the
other workers skip the hub. Every entry is keyed by the hub id (else the model id) and revision.
A cluster-cache entry is complete once its manifest (``.sie-manifest.json``) exists; it is written
last. Downloads log their progress every ``SIE_DOWNLOAD_PROGRESS_INTERVAL_S`` seconds.

Integrity of the cluster cache. The manifest (version 2) holds each file's size and sha256,
computed from the very bytes uploaded: ``{"version": 2, "files": {"model.safetensors": {"size": n,
"sha256": "<hex>"}}, "published_at": t}``. A worker copies an entry into a temporary directory,
hashing each file as it streams, and moves it into the local cache only when every file matches;
a copy that does not match is discarded (a warning names the entry and the file) and fetched once
more, and a second mismatch skips the cluster cache for that load: the hub or the packaged
fallback serves it and the entry is published again over the bad one; with no other tier the load
fails with ``WeightsError`` of class ``INTEGRITY``. A manifest naming a path that would leave the
entry (absolute, ``..``, a drive, the caches' own files) is refused before anything is written.
Version-1 manifests (sizes only, written before the hashes) are NOT trusted: the cluster cache is
skipped for that entry, exactly as for a mismatch, and the entry is published again with hashes
once the weights are loaded from another tier. The local disk cache is trusted as it stands.

What the hashes do not cover: they live in the same bucket as the weights, so they catch a file
swapped or corrupted behind a manifest (and a poisoned path), not a writer who rewrites the
manifest too; against that, keep the bucket writable only by the workers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from protocol import weights as W
from protocol.model_config import ModelConfig

log = logging.getLogger(__name__)

MANIFEST = ".sie-manifest.json"  # cluster cache: written last, marks a complete entry
LAST_USED = ".sie-last-used"  # local cache: its mtime orders the LRU
_TMP_PREFIX = ".tmp-"


class WeightsError(Exception):
    """Weights could not be found; ``error_class`` says why (NOT_FOUND, GATED, NETWORK)."""

    def __init__(self, message: str, error_class: str = "NOT_FOUND", permanent: bool = True) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.permanent = permanent


def resolve_path(source: str) -> Path:
    """A local path or ``pkg://package/subdir`` as a filesystem path (not checked for existence)."""
    if source.startswith("pkg://"):
        package, _, sub = source[len("pkg://") :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise WeightsError(f"package {package!r} is not installed (needed for {source})")
        return Path(next(iter(spec.submodule_search_locations))) / sub
    return Path(source).expanduser()


def hub_offline(settings_offline: bool) -> bool:
    return settings_offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def cache_key(ident: str, revision: str | None = None) -> str:
    """A file-name-safe cache entry name: ``org--name--rev``."""
    raw = f"{ident.strip('/')}--{revision or 'main'}".replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file that vanished while walking
                total += (Path(root) / name).stat().st_size
    return total


def weight_bytes(path: Path | None) -> int:
    """Bytes of the weight files in a directory: an estimate of a model's memory before it loads."""
    if path is None or not path.is_dir():
        return 0
    files = list(path.rglob("*.safetensors")) or list(path.rglob("*.bin")) + list(path.rglob("*.pt"))
    return sum(f.stat().st_size for f in files if f.is_file())


class Progress:
    """Logs how many bytes have arrived under a directory while a download runs."""

    def __init__(
        self,
        label: str,
        path: Path,
        interval_s: float,
        total: int | None = None,
        measure: Callable[[], int] | None = None,
    ) -> None:
        self.label = label
        self.path = path
        self.interval_s = interval_s
        self.total = total
        self.measure = measure or (lambda: dir_size(self.path))
        self.started = time.monotonic()
        self.reports: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{label}", daemon=True)

    def __enter__(self) -> Progress:
        log.info("downloading %s%s", self.label, f" ({_mb(self.total)})" if self.total else "")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            done = self.measure()
            log.info("downloaded %s: %s in %.1f s", self.label, _mb(done), time.monotonic() - self.started)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.report()

    def report(self) -> None:
        done = self.measure()
        self.reports.append(done)
        log.info(
            "downloading %s: %s", self.label, progress_line(done, self.total, time.monotonic() - self.started)
        )


def _mb(n: int | None) -> str:
    return f"{(n or 0) / 1e6:.1f} MB"


def progress_line(done: int, total: int | None, elapsed_s: float, width: int = 20) -> str:
    """``45% [#########-----------] 2.0 MB of 4.4 MB, 5.0 MB/s, 1 s left`` (a bar only when the
    total is known; log lines, not a redrawn terminal bar, so ``sie up`` and ``sie logs`` show it)."""
    rate = done / max(elapsed_s, 1e-6)
    if not total:
        return f"{_mb(done)}, {rate / 1e6:.1f} MB/s"
    share = min(done / total, 1.0)
    filled = round(share * width)
    left = f", {max(total - done, 0) / rate:.0f} s left" if rate > 0 else ""
    return f"{100 * share:.0f}% [{'#' * filled}{'-' * (width - filled)}] {_mb(done)} of {_mb(total)}, {rate / 1e6:.1f} MB/s{left}"


def hub_total_bytes(hub_id: str, revision: str | None, files: tuple[str, ...] | None = None) -> int | None:
    """The size of a hub repository's files (those matching ``files``' patterns, when given): for the
    progress bar and the size cap; None when the hub cannot say."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(hub_id, revision=revision, files_metadata=True)
    except Exception:  # noqa: BLE001 - the download itself reports what is wrong
        return None
    return matching_bytes({s.rfilename: s.size or 0 for s in info.siblings or []}, files) or None


def matching_bytes(sizes: dict[str, int], files: tuple[str, ...] | None) -> int:
    """The bytes of the files (name -> size) that ``snapshot_download(allow_patterns=files)`` takes."""
    from huggingface_hub.utils import filter_repo_objects

    names = filter_repo_objects(sizes, allow_patterns=list(files) if files else None)
    return sum(sizes[name] for name in names)


def check_size(what: str, size: int | None, max_bytes: int | None) -> None:
    """Raise WeightsError (TOO_LARGE) when ``size`` (None: unknown) is above ``max_bytes`` (None: no cap)."""
    if size is not None and max_bytes is not None and size > max_bytes:
        raise WeightsError(f"{what}: {_mb(size)}, more than the cap of {_mb(max_bytes)}", "TOO_LARGE")


# ---- the cluster cache (fsspec) --------------------------------------------------------------
MANIFEST_VERSION = 2  # 1: sizes only (not trusted); 2: size and sha256 per file
_CHUNK = 8 * 1024 * 1024  # bytes per read while hashing a stream: a file is never held whole
_MANIFEST_MAX_BYTES = 16 * 1024 * 1024  # a manifest is read whole: a poisoned one cannot be endless
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RESERVED = (MANIFEST, LAST_USED)  # the caches' own files: never a name in a manifest
_DRIVE = re.compile(r"[A-Za-z]:")


class IntegrityError(WeightsError):
    """A cluster-cache entry that cannot be trusted: a file whose bytes or size differ from its
    manifest, a manifest without hashes (version 1), or a manifest naming a path outside its entry."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        # not permanent: an operator (or another worker) may publish the entry again
        super().__init__(message, "INTEGRITY", permanent=False)
        self.retry = retry  # a copy that did not match: fetching again may meet a finished re-publish


@dataclass(frozen=True)
class ManifestFile:
    size: int
    sha256: str | None  # None only in a version-1 manifest


@dataclass(frozen=True)
class Manifest:
    """A cluster-cache entry's ``.sie-manifest.json``: ``{"version": 2, "files": {rel: {"size": n,
    "sha256": hex}}, "published_at": t}`` (version 1, the old format, is ``{"files": {rel: n}}``)."""

    version: int
    files: dict[str, ManifestFile]

    @property
    def verifiable(self) -> bool:
        """Every file carries a sha256: the only manifests a worker loads from."""
        return self.version >= MANIFEST_VERSION and all(f.sha256 for f in self.files.values())

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self, published_at: float) -> bytes:
        files = {rel: {"size": f.size, "sha256": f.sha256} for rel, f in self.files.items()}
        return json.dumps({"version": self.version, "files": files, "published_at": published_at}).encode()

    @staticmethod
    def parse(raw: bytes, key: str) -> Manifest:
        """Raises IntegrityError for anything but a well-formed manifest whose paths stay inside the entry."""
        try:
            doc = json.loads(raw)
            version = int(doc.get("version", 1))
            items = doc["files"]
            if not isinstance(items, dict):
                raise TypeError("files is not an object")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise IntegrityError(f"cluster cache entry {key}: unreadable manifest ({exc})") from exc
        files = {}
        for rel, spec in items.items():
            safe_rel(rel, key)
            size, sha = (spec, None) if version < 2 else _file_spec(spec)
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise IntegrityError(f"cluster cache entry {key}: bad size for {rel!r} in its manifest")
            if version >= 2 and (not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
                raise IntegrityError(f"cluster cache entry {key}: bad sha256 for {rel!r} in its manifest")
            files[rel] = ManifestFile(size, sha)
        return Manifest(version, files)


def _file_spec(spec: Any) -> tuple[Any, Any]:
    return (spec.get("size"), spec.get("sha256")) if isinstance(spec, dict) else (None, None)


def safe_rel(rel: Any, key: str) -> PurePosixPath:
    """A manifest's file name as a relative path that cannot leave the entry's directory: no absolute
    path, no drive, no ``..``/``.``/empty component, no backslash, not the cache's own bookkeeping."""
    path = PurePosixPath(rel) if isinstance(rel, str) else None
    if (
        path is None
        or not rel
        or rel.startswith("/")
        or "\\" in rel
        or "\x00" in rel
        or path.is_absolute()
        or _DRIVE.match(rel)
        or any(part in ("", ".", "..") for part in rel.split("/"))
        or path.name.startswith(_RESERVED)
    ):
        raise IntegrityError(
            f"cluster cache entry {key}: its manifest names an unsafe path {str(rel)[:200]!r}"
        )
    return path


def _copy_hashing(src: Any, dst: Any, limit: int | None = None) -> tuple[int, str]:
    """Copy one stream into another in chunks; (bytes, sha256 hex). Stops once past ``limit`` bytes."""
    digest = hashlib.sha256()
    size = 0
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        dst.write(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            break
    return size, digest.hexdigest()


class ClusterCache:
    """A shared directory or bucket; entries are ``<root>/<key>/...`` plus a manifest written last."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url
        self.fs, root = url_to_fs(url)
        self.root = root.rstrip("/")

    def _path(self, key: str, rel: str = "") -> str:
        return f"{self.root}/{key}/{rel}" if rel else f"{self.root}/{key}"

    def manifest(self, key: str) -> Manifest | None:
        """The entry's manifest; None when there is none (or the bucket could not be read, logged).
        Raises IntegrityError for a malformed manifest or one naming a path outside the entry."""
        try:
            with self.fs.open(self._path(key, MANIFEST), "rb") as f:
                raw = f.read(_MANIFEST_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except Exception as exc:
            log.warning("cluster cache %s: reading %s failed: %s", self.url, key, exc)
            return None
        if len(raw) > _MANIFEST_MAX_BYTES:
            raise IntegrityError(
                f"cluster cache entry {key}: its manifest is over {_mb(_MANIFEST_MAX_BYTES)}"
            )
        return Manifest.parse(raw, key)

    def keys(self) -> frozenset[str]:
        """The complete entries (those with a manifest, of any version), in one listing. Raises
        OSError and the like. Manifests are not read here: a listed entry may still be refused
        when it is fetched (version 1, or a file that does not match)."""
        return frozenset(
            path.rstrip("/").rsplit("/", 2)[-2] for path in self.fs.glob(f"{self.root}/*/{MANIFEST}")
        )

    def fetch(self, key: str, manifest: Manifest, dest: Path) -> None:
        """Copy the entry's files into ``dest`` (a fresh directory), checking each file's size and
        sha256 against the manifest as it streams. Raises IntegrityError on the first mismatch (what
        was written stays in ``dest``, for the caller to discard) or for a version-1 manifest."""
        if not manifest.verifiable:
            raise IntegrityError(
                f"cluster cache entry {key}: its manifest (version {manifest.version}) has no sha256 "
                "per file, so it is not trusted (a worker that loads these weights from another tier "
                "publishes the entry again, with hashes)"
            )
        root = dest.resolve()
        for rel, want in manifest.files.items():
            target = dest / safe_rel(rel, key)
            if not target.resolve().is_relative_to(root):  # a link inside dest: never write through it
                raise IntegrityError(f"cluster cache entry {key}: {rel!r} leaves the entry")
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open(self._path(key, rel), "rb") as src, target.open("xb") as dst:
                size, sha = _copy_hashing(src, dst, limit=want.size)
            if size != want.size or sha != want.sha256:
                why = "sha256 differs" if size == want.size else f"size {size} != {want.size}"
                raise IntegrityError(
                    f"cluster cache entry {key}: file {rel[:200]!r} does not match its manifest ({why})",
                    retry=True,
                )

    def publish(self, key: str, source: Path, replace: bool = False) -> bool:
        """Upload a local directory under ``key`` unless a trusted entry (a version-2 manifest) is
        there already; ``replace``: even then (the entry was refused). True when uploaded. Each file
        is hashed as it is uploaded, so the manifest holds the sha256 of exactly the bytes sent."""
        try:
            existing = self.manifest(key)
        except IntegrityError:
            existing = None  # malformed: replaced
        if existing is not None and existing.verifiable and not replace:
            return False
        if existing is not None or replace:
            # the old manifest goes first: while the files are replaced the entry reads as incomplete
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._path(key, MANIFEST))
        files = {}
        for path in sorted(source.rglob("*")):
            rel = path.relative_to(source).as_posix()
            if (
                not path.is_file()
                or rel.startswith(".cache/")
                or Path(rel).name.startswith((LAST_USED, MANIFEST))
            ):
                continue
            remote = self._path(key, rel)
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            with path.open("rb") as src, self.fs.open(remote, "wb") as dst:
                size, sha = _copy_hashing(src, dst)
            files[rel] = ManifestFile(size, sha)
        manifest = Manifest(MANIFEST_VERSION, files)
        # written under a temporary name, then moved: readers never see half a manifest
        tmp = self._path(key, f"{MANIFEST}.{uuid.uuid4().hex[:8]}")
        self.fs.pipe_file(tmp, manifest.to_json(time.time()))
        self.fs.mv(tmp, self._path(key, MANIFEST))
        log.info("published %s to the cluster cache %s (%s)", key, self.url, _mb(manifest.total))
        return True


# ---- the three tiers -------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One thing to resolve: a cache identity plus the places it may come from."""

    ident: str  # hub id, else model id: names the cache entry
    revision: str | None = None
    local_path: str | None = None  # used in place when it exists
    hub_id: str | None = None
    fallback: str | None = None  # pkg:// or a local path, last resort
    files: tuple[str, ...] | None = None  # from the hub only these (allow_patterns); None: every file
    max_bytes: int | None = None  # a hub download above this is refused (before it starts when the hub says)

    @property
    def key(self) -> str:
        return cache_key(self.ident, self.revision)

    @staticmethod
    def of_model(config: ModelConfig) -> Source:
        return Source(
            ident=config.hf_id or config.sie_id,
            revision=config.hf_revision,
            local_path=config.weights_path,
            hub_id=config.hf_id,
            fallback=config.weights_fallback,
        )


class WeightCache:
    def __init__(
        self,
        disk_dir: str | Path,
        *,
        cluster_url: str = "",
        offline: bool = False,
        disk_threshold_percent: float = 85.0,
        disk_budget_bytes: int = 0,
        progress_interval_s: float = 10.0,
    ) -> None:
        self.disk_dir = Path(disk_dir).expanduser()
        self.cluster = ClusterCache(cluster_url) if cluster_url else None
        self.offline = offline
        self.disk_threshold_percent = disk_threshold_percent
        self.disk_budget_bytes = disk_budget_bytes
        self.progress_interval_s = progress_interval_s
        self.evicted: list[str] = []
        self._lock = threading.Lock()
        self._busy: dict[str, int] = {}
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-upload")
        self._pending: list[Future[Any]] = []

    @classmethod
    def from_settings(cls, settings: Any) -> WeightCache:
        return cls(
            settings.disk_cache_dir,
            cluster_url=settings.cluster_cache_url,
            offline=settings.hf_offline,
            disk_threshold_percent=settings.disk_pressure_threshold_percent,
            disk_budget_bytes=settings.disk_budget_bytes,
            progress_interval_s=settings.download_progress_interval_s,
        )

    # ---- public ----------------------------------------------------------------------------
    def resolve_model(self, config: ModelConfig, protect: Iterable[str] = ()) -> Path | None:
        """The local directory holding the model's weights (``None`` for package-backed models)."""
        if config.package_backed and not (config.weights_path or config.hf_id or config.weights_fallback):
            return None
        return self.resolve(Source.of_model(config), protect)

    def resolve(self, source: Source, protect: Iterable[str] = ()) -> Path:
        key = source.key
        with self._lock:
            self._busy[key] = self._busy.get(key, 0) + 1
        try:
            return self._resolve(source, key, set(protect) | {key})
        finally:
            with self._lock:
                self._busy[key] -= 1
                if not self._busy[key]:
                    del self._busy[key]

    def flush(self) -> None:
        """Wait for background uploads to the cluster cache (tests, shutdown)."""
        while self._pending:
            self._pending.pop(0).result()

    def close(self) -> None:
        self._uploads.shutdown(wait=False, cancel_futures=True)

    def local_entries(self) -> list[str]:
        """Complete local-cache entries, least recently used first."""
        if not self.disk_dir.is_dir():
            return []
        entries = [p for p in self.disk_dir.iterdir() if p.is_dir() and not p.name.startswith(_TMP_PREFIX)]
        return [p.name for p in sorted(entries, key=_last_used)]

    def disk_usage(self) -> tuple[int, int]:
        """(used, total) bytes: the cache's own entries against the synthetic budget, else the disk."""
        if self.disk_budget_bytes > 0:
            return sum(dir_size(self.disk_dir / k) for k in self.local_entries()), self.disk_budget_bytes
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        du = shutil.disk_usage(self.disk_dir)
        return du.used, du.total

    def enforce_disk_pressure(self, protect: Iterable[str] = ()) -> list[str]:
        """Delete least recently used entries while the disk is above the threshold."""
        with self._lock:
            keep = set(protect) | set(self._busy)
        evicted = []
        for key in self.local_entries():
            used, total = self.disk_usage()
            if total <= 0 or 100.0 * used / total <= self.disk_threshold_percent:
                break
            if key in keep:
                continue
            log.warning(
                "disk cache above %.0f%% (%s of %s): evicting %s",
                self.disk_threshold_percent,
                _mb(used),
                _mb(total),
                key,
            )
            shutil.rmtree(self.disk_dir / key, ignore_errors=True)
            evicted.append(key)
        self.evicted.extend(evicted)
        return evicted

    # ---- tiers -----------------------------------------------------------------------------
    def _resolve(self, source: Source, key: str, protect: set[str]) -> Path:
        if source.local_path:
            path = resolve_path(source.local_path)
            if path.exists():
                self._publish(key, path)
                return path
        local = self.disk_dir / key
        if local.is_dir():
            _touch(local)
            return local
        errors: list[WeightsError] = []
        refused = False  # the cluster entry exists but was not trusted: replaced once loaded elsewhere
        if self.cluster is not None:
            try:
                cluster_path = self._from_cluster(source, key, protect)
            except WeightsError as exc:
                errors.append(exc)
                refused = isinstance(exc, IntegrityError)
            else:
                if cluster_path is not None:
                    return cluster_path
        if source.hub_id:
            try:
                path = self._from_hub(source, key, protect)
                self._publish(key, path, replace=refused)
                return path
            except WeightsError as exc:
                if exc.error_class == "GATED":
                    raise
                errors.append(exc)
        if source.fallback:
            path = resolve_path(source.fallback)
            if path.exists():
                if source.hub_id and errors:
                    log.info("%s: hub unavailable, using packaged weights at %s", source.ident, path)
                self._publish(key, path, replace=refused)
                return path
            errors.append(WeightsError(f"fallback weights {source.fallback} do not exist"))
        if source.local_path:
            errors.insert(0, WeightsError(f"weights_path {source.local_path} does not exist"))
        if errors:
            errors.sort(key=lambda e: not isinstance(e, IntegrityError))  # a refused entry says most
            raise (
                errors[0]
                if len(errors) == 1
                else WeightsError(
                    "; ".join(str(e) for e in errors), errors[0].error_class, errors[0].permanent
                )
            )
        where = " or the cluster cache" if self.cluster else ""
        raise WeightsError(
            f"{source.ident} names no weights source (weights_path, hf_id or weights_fallback) "
            f"and is not in the local disk cache{where}"
        )

    def _fill(self, key: str, download: Callable[[Path], None], protect: set[str]) -> Path:
        """Download into a temporary directory, then move it into place atomically."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.disk_dir / f"{_TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        final = self.disk_dir / key
        try:
            download(tmp)
            shutil.rmtree(tmp / ".cache", ignore_errors=True)  # the hub's download bookkeeping
            _touch(tmp)
            try:
                tmp.rename(final)
            except OSError:
                if not final.is_dir():
                    raise
                log.info("%s: another process filled the cache first", key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.enforce_disk_pressure(protect)
        return final

    def _from_cluster(self, source: Source, key: str, protect: set[str]) -> Path | None:
        """The entry copied from the cluster cache into the local one, each file's size and sha256
        checked before the copy is moved into place; None when the cluster cache has no such entry.
        A copy that does not match is discarded and fetched once more (a publisher may have been
        replacing the entry meanwhile); a second mismatch, a version-1 manifest, or a manifest that
        names a path outside the entry raise IntegrityError, a failed read WeightsError (NETWORK):
        the caller goes on to the next tier."""
        assert self.cluster is not None
        cluster = self.cluster
        refusal: IntegrityError | None = None
        for attempt in (1, 2):
            try:
                manifest = cluster.manifest(key)  # read again on the second try
                if manifest is None:
                    return None
                path = self._fill(key, functools.partial(self._fetch_cluster, key, manifest), protect)
            except IntegrityError as exc:
                refusal = exc
                again = exc.retry and attempt == 1
                then = "fetching it again" if again else "skipping the cluster cache for this load"
                log.warning("%s: %s; %s", source.ident, exc, f"copy discarded, {then}" if exc.retry else then)
                if not again:
                    break
                continue
            except Exception as exc:  # the bucket failed mid-copy: the next tier may serve it
                log.warning("%s: copying cluster cache entry %s failed: %s", source.ident, key, exc)
                raise WeightsError(
                    f"cluster cache entry {key}: copy failed ({exc})", "NETWORK", permanent=False
                ) from exc
            log.info("%s: weights from the cluster cache %s (sha256 checked)", source.ident, cluster.url)
            return path
        assert refusal is not None
        raise refusal

    def _fetch_cluster(self, key: str, manifest: Manifest, tmp: Path) -> None:
        assert self.cluster is not None
        with Progress(f"{key} from {self.cluster.url}", tmp, self.progress_interval_s, manifest.total):
            self.cluster.fetch(key, manifest, tmp)

    def _from_hub(self, source: Source, key: str, protect: set[str]) -> Path:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        hub_id = source.hub_id or ""
        patterns = list(source.files) if source.files else None
        try:
            if hub_offline(self.offline):
                # offline: only what the hub client has cached already, nothing is fetched
                return Path(
                    snapshot_download(
                        hub_id, revision=source.revision, local_files_only=True, allow_patterns=patterns
                    )
                )

            def download(tmp: Path) -> None:
                total = hub_total_bytes(hub_id, source.revision, source.files)
                check_size(hub_id, total, source.max_bytes)  # before a byte is fetched, when the hub says
                with Progress(f"{hub_id} from the hub", tmp, self.progress_interval_s, total):
                    snapshot_download(
                        hub_id, revision=source.revision, local_dir=str(tmp), allow_patterns=patterns
                    )
                if source.max_bytes is not None:
                    # and what arrived (the hub client's .cache bookkeeping aside): above the cap it is
                    # never moved into the cache
                    check_size(hub_id, dir_size(tmp) - dir_size(tmp / ".cache"), source.max_bytes)

            return self._fill(key, download, protect)
        except GatedRepoError as exc:
            raise WeightsError(f"{hub_id} is gated: set HF_TOKEN with access ({exc})", "GATED") from exc
        except RepositoryNotFoundError as exc:
            raise WeightsError(f"{hub_id} does not exist on the hub", "NOT_FOUND") from exc
        except WeightsError:  # refused above the cap
            raise
        except Exception as exc:  # network down, offline cache miss, ...
            raise WeightsError(f"{hub_id}: hub unreachable or not cached ({exc})", "NETWORK") from exc

    def _publish(self, key: str, path: Path, replace: bool = False) -> None:
        if self.cluster is None:
            return
        cluster = self.cluster

        def upload() -> None:
            try:
                cluster.publish(key, path, replace=replace)
            except Exception:
                log.exception("publishing %s to the cluster cache %s failed", key, cluster.url)

        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._uploads.submit(upload))


# ---- where the weights are, without fetching them (GET /v1/models "weights") ----------------
HUB_PROBE_TIMEOUT_S = 3.0


def hub_answers(endpoint: str | None = None, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub (``endpoint``, default ``HF_ENDPOINT`` or huggingface.co) answers
    one bounded request; any HTTP answer, an error status included, means it is reachable."""
    import urllib.error
    import urllib.request

    if endpoint is None:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _local(source: str | None) -> bool:
    if not source:
        return False
    try:
        return resolve_path(source).exists()
    except WeightsError:  # pkg:// of a package that is not installed
        return False


def _in_hub_cache(hub_id: str, revision: str | None) -> bool:
    """Offline, the loader reads the hub client's own cache: is the snapshot there? (Nothing is fetched.)"""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(hub_id, revision=revision, local_files_only=True)
        return True
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError) or unreadable
        return False


def weights_status(
    config: ModelConfig, cache: WeightCache, *, cluster_keys: frozenset[str] | None, hub: bool
) -> str:
    """Where ``config``'s weights would come from now (protocol.weights), checked without fetching
    anything, through the places the loader looks: on this machine (``weights_path``, the local disk
    cache, the hub client's cache when offline, the packaged fallback, or code in a package), the
    cluster cache (``cluster_keys``; None: it could not be read), the hub (``hub``: it answered)."""
    if config.package_backed and not (config.weights_path or config.hf_id or config.weights_fallback):
        return W.CACHED
    source = Source.of_model(config)
    offline = hub_offline(cache.offline)
    if (
        _local(source.local_path)
        or (cache.disk_dir / source.key).is_dir()
        or (source.hub_id and offline and _in_hub_cache(source.hub_id, source.revision))
        or _local(source.fallback)
    ):
        return W.CACHED
    if cluster_keys is not None and source.key in cluster_keys:
        return W.CLUSTER_CACHE
    if source.hub_id and not offline and hub:
        return W.HUB
    return W.UNKNOWN if cluster_keys is None else W.MISSING


class WeightsReport:
    """``weights_status`` of every model, checked together: one hub probe and one cluster-cache
    listing per check. ``check`` blocks (run it in a thread); ``latest`` is the last result ({}
    before the first check)."""

    def __init__(self, cache: WeightCache, probe: Callable[[], bool] = hub_answers) -> None:
        self.cache = cache
        self.probe = probe
        self.latest: dict[str, str] = {}

    def check(self, configs: Iterable[ModelConfig]) -> dict[str, str]:
        cluster_keys: frozenset[str] | None = frozenset()
        if self.cache.cluster is not None:
            try:
                cluster_keys = self.cache.cluster.keys()
            except Exception as exc:  # noqa: BLE001 - a bucket without access: say unknown
                log.warning("cluster cache %s: listing failed: %s", self.cache.cluster.url, exc)
                cluster_keys = None
        hub = not hub_offline(self.cache.offline) and self.probe()
        self.latest = {
            c.sie_id: weights_status(c, self.cache, cluster_keys=cluster_keys, hub=hub) for c in configs
        }
        return self.latest


_clock_lock = threading.Lock()
_clock_last = 0


def _touch(entry: Path) -> None:
    """Record a use: a strictly increasing wall-clock stamp (ns) inside the entry."""
    global _clock_last
    with _clock_lock:
        _clock_last = max(time.time_ns(), _clock_last + 1)
        stamp = _clock_last
    (entry / LAST_USED).write_text(str(stamp))


def _last_used(entry: Path) -> int:
    try:
        return int((entry / LAST_USED).read_text())
    except (OSError, ValueError):
        return 0
