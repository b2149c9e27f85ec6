"""ModelRegistry mirrored from the config service : bootstrap, deltas, epoch poll.

:class:`ConfigServiceRegistry` is the gateway's registry when ``SIE_CONFIG_SERVICE_URL`` is set.
It starts empty and not ready (``/readyz`` 503) and never blocks the gateway's start-up:

* **bootstrap** (background, retried with backoff 1 s → 60 s until it succeeds):
  ``GET /v1/configs/epoch`` (fingerprint taken first), ``GET /v1/configs/bundles`` and each
  ``/v1/configs/bundles/{id}``, then ``GET /v1/configs/export``. Everything is parsed before
  anything is installed; the models and bundles are then replaced in one step and the local
  epoch becomes the export's epoch (also when that is *lower* than before: the config service
  lost its state and the export is the truth).
* **deltas** on ``sie.config.models._all``, which only the config service's NATS user may publish
  (protocol/nats_permissions.py: the server refuses anyone else): a delta for epoch ``local + 1`` is applied and
  advances the epoch; the per-bundle copies of the same write (same epoch) only refresh that
  bundle's expected hash; an older delta is dropped (it could undo a newer write); a delta that
  skips epochs is applied and a re-export is scheduled for what was missed. A tombstone
  (``deleted``, after a DELETE or a PUT that moved the model off a bundle) removes the model: the
  gateway then answers 404 MODEL_NOT_FOUND for it. The export agrees (a deleted model is not in
  it), so a restarted gateway does not bring it back. A pure epoch bump (empty ``model_config``)
  schedules a re-export.
* **poll** of ``GET /v1/configs/epoch`` every ``SIE_CONFIG_POLL_INTERVAL_S`` (first tick skipped):
  a different epoch (higher *or* lower) or a changed bundle set re-runs the bootstrap.

Deltas and exports are serialised by one lock, so a delta never interleaves with an install.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import yaml

from gateway.config_client import ConfigClient
from gateway.registry import CatalogRegistry, ConfigEpoch, ConfigModels, Route
from protocol.catalog import Catalog
from protocol.config_delta import (
    ConfigDelta,
    ConfigDeltaError,
    EpochInfo,
    EpochOrder,
    decode_config_delta,
    epoch_bump_is_news,
    epoch_order,
)
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import bundles_hash, parse_model_yaml
from protocol.subjects import CONFIG_ALL

log = logging.getLogger("gateway.config_sync")

DEGRADED_AFTER_ATTEMPTS = 10
DEGRADED_AFTER_S = 300.0


class SyncedConfigEpoch(ConfigEpoch):
    """``GET /v1/configs/epoch`` of a gateway that mirrors the config service."""

    bootstrapped: bool
    last_sync_at: float | None  # unix seconds of the last export or delta applied


class ConfigServiceRegistry(CatalogRegistry):
    """The gateway's registry fed by the config service (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        poll_interval_s: float = 30.0,
        http_timeout_s: float = 10.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        super().__init__(Catalog())
        self.client = ConfigClient(url, token=token, http_timeout_s=http_timeout_s)
        self.poll_interval_s = poll_interval_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.epoch = 0
        self.bootstrapped = False
        self.exports = 0  # successful exports installed (tests and /v1/configs/epoch read it)
        self.last_sync_at: float | None = None
        self._raw_yaml: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        self._remote_hashes: dict[str, str] = {}
        self._remote_pool_hashes: dict[str, dict[str, str]] = {}
        self._last_poll: EpochInfo | None = None
        self._lock = asyncio.Lock()
        self._resync = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self._metrics: Any = None

    # ---- ModelRegistry --------------------------------------------------------------------
    def ready(self) -> bool:
        return self.bootstrapped

    def resolve(self, spec: str, options: dict[str, Any] | None = None) -> Route:
        if not self.bootstrapped:
            raise SIEError(
                ErrorCode.QUEUE_UNAVAILABLE,
                "The gateway has not loaded the model configuration from the config service yet; retry",
                retry_after=2,
            )
        return super().resolve(spec, options)

    def bundle_hash(self, bundle: str) -> str:
        remote = self._remote_hashes.get(bundle)
        if remote is not None:
            return remote
        return super().bundle_hash(bundle)

    def expected_hash(self, bundle: str, pool: str) -> str:
        """The sidecar's rule: the pool-scoped hash when the control plane published one, else the bundle's."""
        scoped = self._remote_pool_hashes.get(bundle, {}).get(pool.lower())
        return scoped if scoped is not None else self.bundle_hash(bundle)

    # ---- read-side config API (the gateway's mirror) --------------------------------------
    def config_models(self) -> ConfigModels:
        return {
            "models": [
                {
                    "model_id": m.sie_id,
                    "profiles": sorted(m.profiles),
                    "source": self._sources.get(m.sie_id, "api"),
                }
                for m in sorted(self.catalog.models(), key=lambda m: m.sie_id)
            ]
        }

    def config_model_yaml(self, model_id: str) -> str | None:
        config = self.catalog.get(model_id)
        if config is None:
            return None
        return self._raw_yaml.get(model_id) or yaml.safe_dump(
            config.model_dump(mode="json", exclude_none=True), sort_keys=False
        )

    def config_epoch(self) -> SyncedConfigEpoch:
        return {
            "epoch": self.epoch,
            "bundles_hash": bundles_hash(self.catalog.bundles()),
            "bootstrapped": self.bootstrapped,
            "source": "config_service",
            "last_sync_at": self.last_sync_at,
        }

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, nc: Any, metrics: Any = None) -> None:
        """Subscribe to deltas and start the bootstrap/poll task; returns at once."""
        self._metrics = metrics
        self.client.open()
        if nc is not None:
            self._sub = await nc.subscribe(CONFIG_ALL, cb=self._on_delta)
        self._tasks.append(asyncio.create_task(self._run(), name="config-sync"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        await self.client.close()

    async def _run(self) -> None:
        await self._bootstrap_until_done()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resync.wait(), self.poll_interval_s)
            try:
                if self._resync.is_set():
                    self._resync.clear()
                    await self.sync()
                else:
                    await self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the config service being down is normal
                self._count_failure()
                log.warning("config sync failed (keeping epoch %d): %s", self.epoch, exc)

    async def _bootstrap_until_done(self) -> None:
        delay = self.backoff_initial_s
        attempts = 0
        started = time.monotonic()
        while True:
            try:
                await self.sync()
                self._set_degraded(False)
                return
            except Exception as exc:  # noqa: BLE001
                attempts += 1
                self._count_failure()
                if attempts >= DEGRADED_AFTER_ATTEMPTS or time.monotonic() - started >= DEGRADED_AFTER_S:
                    self._set_degraded(True)
                log.warning(
                    "config bootstrap attempt %d failed, retrying in %.0f s: %s", attempts, delay, exc
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)

    # ---- poll and export -------------------------------------------------------------------
    async def poll_once(self) -> bool:
        """One epoch poll; re-exports on drift. True when an export ran."""
        info = await self.client.epoch_info()
        previous, self._last_poll = self._last_poll, info
        drift = info.epoch != self.epoch
        if info.bundles_hash and info.bundles_hash != bundles_hash(self.catalog.bundles()):
            drift = True
        if (
            previous is not None
            and previous.epoch == info.epoch
            and previous.bundle_config_hashes_hash
            and info.bundle_config_hashes_hash
            and previous.bundle_config_hashes_hash != info.bundle_config_hashes_hash
        ):
            drift = True  # configs changed without an epoch bump (a restarted service, new images)
        if not drift:
            return False
        log.info("config drift: remote epoch %d, local %d; re-exporting", info.epoch, self.epoch)
        await self.sync()
        return True

    async def sync(self) -> None:
        """Epoch → bundles → export, parsed fully, then installed in one step."""
        snap = await self.client.snapshot()
        export = snap.export
        async with self._lock:
            self.catalog.replace(snap.models, snap.bundles)
            self._raw_yaml = snap.raw_yaml
            self._sources = snap.sources
            self._remote_hashes = dict(export.bundle_config_hashes)
            self._remote_pool_hashes = {b: dict(h) for b, h in export.bundle_pool_config_hashes.items()}
            self._hashes.clear()
            if export.epoch < self.epoch:
                log.warning("config service epoch went back from %d to %d; reset", self.epoch, export.epoch)
            self._set_epoch(export.epoch)
            self._last_poll = snap.info if snap.info.epoch == export.epoch else None
            self.bootstrapped = True
            self.exports += 1
            self.last_sync_at = time.time()
        log.info(
            "config export installed: epoch %d, %d models, %d bundles",
            export.epoch,
            len(snap.models),
            len(snap.bundles),
        )

    # ---- deltas ----------------------------------------------------------------------------
    async def _on_delta(self, msg: Any) -> None:
        await self.apply_delta(msg.data)

    async def apply_delta(self, data: bytes) -> str:
        """Apply one ``_all`` delta; returns the result label counted in the metrics."""
        kind = "unknown"
        try:
            delta = decode_config_delta(data)
        except ConfigDeltaError as exc:
            log.warning("undecodable config delta dropped: %s", exc)
            return self._count(kind, "invalid")
        kind = "epoch_bump" if delta.is_epoch_bump else "tombstone" if delta.is_tombstone else "model"
        async with self._lock:
            if not self.bootstrapped:
                return self._count(kind, "before_bootstrap")  # the first export will carry it
            if delta.is_epoch_bump:
                if epoch_bump_is_news(delta.epoch, self.epoch):
                    self._resync.set()
                    return self._count(kind, "resync")
                return self._count(kind, "stale")
            order = epoch_order(delta.epoch, self.epoch)
            if order == EpochOrder.STALE:
                return self._count(kind, "stale")
            if order == EpochOrder.DUPLICATE:
                # another per-bundle copy of the write already applied: only its bundle's hash
                self._note_hashes(delta)
                return self._count(kind, "duplicate")
            if delta.is_tombstone:
                return self._count(kind, self._apply_tombstone(delta, order))
            try:
                config = parse_model_yaml(delta.model_config_yaml)
            except Exception as exc:  # noqa: BLE001 - leave the epoch behind; the poll repairs it
                log.warning(
                    "config delta for %r (epoch %d) not applied: %s", delta.model_id, delta.epoch, exc
                )
                self._resync.set()
                return self._count(kind, "parse_error")
            gap = order == EpochOrder.GAP
            self.catalog.put(config)
            self._raw_yaml[config.sie_id] = delta.model_config_yaml
            self._sources[config.sie_id] = "api"
            self._hashes.clear()
            for bundle in delta.affected_bundles:
                self._remote_hashes.pop(bundle, None)  # recomputed until the service says otherwise
            self._note_hashes(delta)
            if gap:
                self._resync.set()  # epochs in between were missed: the export fills them in
                log.info(
                    "config delta epoch %d after local %d: applied, re-exporting", delta.epoch, self.epoch
                )
            self._set_epoch(delta.epoch)
            self.last_sync_at = time.time()
            return self._count(kind, "applied_gap" if gap else "applied")

    def _note_hashes(self, delta: ConfigDelta) -> None:
        """The expected hashes a delta carries: its bundle's, and the pool-scoped ones of its bundles."""
        if delta.bundle_id and delta.bundle_config_hash:
            self._remote_hashes[delta.bundle_id] = delta.bundle_config_hash
        for bundle, pools in delta.bundle_pool_config_hashes.items():
            self._remote_pool_hashes[bundle] = dict(pools)

    def _apply_tombstone(self, delta: ConfigDelta, order: EpochOrder) -> str:
        """The model is gone (held under the lock): out of the catalog and the config mirror."""
        self.catalog.remove(delta.model_id)
        self._raw_yaml.pop(delta.model_id, None)
        self._sources.pop(delta.model_id, None)
        self._hashes.clear()
        for bundle in delta.affected_bundles:
            self._remote_hashes.pop(bundle, None)
        self._note_hashes(delta)
        if order == EpochOrder.GAP:
            self._resync.set()
        log.info("model %s deleted (epoch %d)", delta.model_id, delta.epoch)
        self._set_epoch(delta.epoch)
        self.last_sync_at = time.time()
        return "applied_gap" if order == EpochOrder.GAP else "applied"

    # ---- metrics ---------------------------------------------------------------------------
    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self._metrics is not None:
            self._metrics.config_epoch.set(epoch)

    def _count(self, kind: str, result: str) -> str:
        if self._metrics is not None:
            self._metrics.config_deltas.labels(kind, result).inc()
        return result

    def _count_failure(self) -> None:
        if self._metrics is not None:
            self._metrics.config_bootstrap_failures.inc()

    def _set_degraded(self, value: bool) -> None:
        if self._metrics is not None:
            self._metrics.config_bootstrap_degraded.set(1 if value else 0)
