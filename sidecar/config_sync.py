"""Config deltas and reconciliation for one worker pod.

``ConfigApplier`` subscribes to ``sie.config.models.{bundle}``; for every delta it checks

- the delta is for this bundle and this pool,
- the epoch is newer than the one applied (``protocol.config_delta.epoch_order``: stale or duplicate is dropped),

then, holding the execution barrier exclusively (no batch on the worker meanwhile), sends
``ApplyModelConfig`` to the worker (``deleted: true`` for a tombstone: the worker drops the model
and unloads it), retrying transport errors with backoff (250 ms → 5 s). The
change is committed — epoch, advertised ``bundle_config_hash`` and ``unsupported_models``
together — only when the hash the worker computed equals the control plane's non-empty hash
(pool-scoped when the delta carries it). On a mismatch nothing advances: the heartbeat keeps the
last verified hash, so gateways see the worker as out of date until reconciliation heals it.

With ``SIE_CONFIG_SERVICE_URL`` set, a reconciler polls ``/v1/configs/epoch`` every
``SIE_WORKER_CONFIG_POLL_INTERVAL_MS`` and takes the full ``/v1/configs/export`` at start-up, every
``SIE_WORKER_CONFIG_FULL_EXPORT_INTERVAL_MS``, and whenever the epoch poll shows a change; the
bundle's models go to the worker with ``ReplaceModelConfigs`` under the same rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from nats.aio.msg import Msg

from iokit.replicas import ReplicaUrls
from protocol import ipc
from protocol.config_delta import (
    ConfigDelta,
    ConfigDeltaError,
    ConfigExport,
    EpochInfo,
    EpochOrder,
    decode_config_delta,
    epoch_order,
    parse_epoch_info,
    parse_export,
)
from protocol.subjects import config_subject
from sidecar.barrier import ExecutionBarrier
from sidecar.ipc_client import IpcClient, IpcRemoteError, IpcTransportError
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar.config")

RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
RETRY_ATTEMPTS = 8  # then give up: the reconciler heals
HTTP_TIMEOUT_S = 30.0

# handle_delta outcomes
APPLIED = "applied"
MISMATCH = "mismatch"
FAILED = "failed"
INVALID = "invalid"
OTHER_BUNDLE = "other_bundle"
OTHER_POOL = "other_pool"
STALE = "stale"
EPOCH_BUMP = "epoch_bump"


class ConfigApplier:
    def __init__(
        self,
        nc: Any,
        ipc_client: IpcClient,
        settings: SidecarSettings,
        barrier: ExecutionBarrier,
        *,
        current_hash: Callable[[], str] = lambda: "",
    ) -> None:
        self.nc = nc
        self.ipc = ipc_client
        self.settings = settings
        self.barrier = barrier
        self.bundle = settings.bundle
        self.pool = settings.pool.lower()
        self._current_hash = current_hash  # what the worker reports (Ping) before anything is verified
        self.epoch = 0
        self.verified_hash: str | None = None
        self.unsupported_models: list[str] = []
        self.last_info: EpochInfo | None = None
        self.stats: dict[str, int] = {}
        self._apply_lock = asyncio.Lock()
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._reconcile_now = asyncio.Event()
        self._stop = asyncio.Event()
        self._sub = None
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self.replicas = ReplicaUrls(settings.config_service_url) if settings.config_service_url else None
        self._rewind = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._sub = await self.nc.subscribe(config_subject(self.bundle), cb=self._on_msg)
        self._tasks.append(asyncio.create_task(self._delta_loop(), name="sidecar-config-deltas"))
        if self.settings.config_service_url:
            headers = (
                {"Authorization": f"Bearer {self.settings.config_service_token}"}
                if self.settings.config_service_token
                else None
            )
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S), headers=headers
            )
            self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="sidecar-config-reconcile"))

    async def stop(self) -> None:
        self._stop.set()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        self._tasks = []
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None

    def advertised_hash(self) -> str:
        """The heartbeat's ``bundle_config_hash``: the last verified one (the worker's own until then)."""
        return self.verified_hash if self.verified_hash is not None else (self._current_hash() or "")

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    # ------------------------------------------------------------------ deltas
    async def _on_msg(self, msg: Msg) -> None:
        # Queue and return: the subscription's callback task never blocks on the barrier.
        self._queue.put_nowait(msg.data)

    async def _delta_loop(self) -> None:
        while not self._stop.is_set():
            data = await self._queue.get()
            try:
                await self.handle_delta(data)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad delta never stops the loop
                log.exception("handling a config delta failed")

    def check(self, delta: ConfigDelta) -> str | None:
        """Why a delta is ignored, or None when it is to be applied."""
        if delta.bundle_id != self.bundle:
            return OTHER_BUNDLE
        if (delta.pool or "default").lower() != self.pool:
            return OTHER_POOL
        if epoch_order(delta.epoch, self.epoch) in (EpochOrder.STALE, EpochOrder.DUPLICATE):
            return STALE
        return None

    async def handle_delta(self, data: bytes) -> str:
        """Check and apply one delta; returns what happened (one of the module's outcome names)."""
        self._count("received")
        try:
            delta = decode_config_delta(data)
        except ConfigDeltaError as exc:
            log.warning("ignoring undecodable config delta: %s", exc)
            self._count(INVALID)
            return INVALID
        async with self._apply_lock:
            reason = self.check(delta)
            if reason is not None:
                log.log(
                    logging.DEBUG,
                    "ignoring config delta from %r for %s/%s epoch %d: %s",
                    delta.router_id,
                    delta.bundle_id,
                    delta.pool,
                    delta.epoch,
                    reason,
                )
                self._count(reason)
                return reason
            if delta.is_epoch_bump:
                self._count(EPOCH_BUMP)
                self._reconcile_now.set()  # the full state comes with the export
                return EPOCH_BUMP
            scoped = self.pool in delta.bundle_pool_config_hashes.get(self.bundle, {})
            expected = delta.expected_hash(self.bundle, self.pool)
            body = {
                "bundle_id": self.bundle,
                "model_id": delta.model_id,
                "epoch": delta.epoch,
                "bundle_config_hash": expected,
                "model_config": delta.model_config_yaml,
                "profiles_added": list(delta.profiles_added),
                "bundle_adapters": list(delta.bundle_adapters.get(self.bundle) or []),
                "pool": self.pool,
                "pool_scoped": scoped,
                "deleted": delta.is_tombstone,
            }
            resp = await self._call(ipc.APPLY_MODEL_CONFIG, body)
            if resp is None:
                self._count(FAILED)
                return FAILED
            # after a tombstone the bundle may serve nothing: an empty hash is then the right one
            what = f"{'tombstone' if delta.is_tombstone else 'delta'} {delta.model_id}"
            return self._commit(delta.epoch, expected, resp, what=what, allow_empty=delta.is_tombstone)

    def _commit(
        self,
        epoch: int,
        expected: str,
        resp: dict[str, Any],
        *,
        what: str,
        allow_empty: bool,
        rewind: bool = False,
    ) -> str:
        got = resp.get("bundle_config_hash") or ""
        if got != expected or (not expected and not allow_empty):
            log.warning(
                "%s (epoch %d): worker hash %r != control plane %r; keeping %r (epoch %d) until reconciled",
                what,
                epoch,
                got[:12],
                expected[:12],
                (self.advertised_hash() or "")[:12],
                self.epoch,
            )
            self._count(MISMATCH)
            return MISMATCH
        self.epoch = epoch if rewind else max(self.epoch, epoch)
        self.verified_hash = got
        unsupported = resp.get("unsupported_models") or []
        self.unsupported_models = sorted(str(m) for m in unsupported) if isinstance(unsupported, list) else []
        log.info("%s applied: epoch %d, bundle_config_hash %s", what, self.epoch, got[:12])
        self._count(APPLIED)
        return APPLIED

    async def _call(self, method: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """One config call under the exclusive barrier; transport errors retried with backoff."""
        if self.verified_hash is None:
            # From now on the heartbeat says only what was verified: freeze what it says today.
            self.verified_hash = self._current_hash() or ""
        delay = RETRY_FIRST_S
        for attempt in range(1, RETRY_ATTEMPTS + 1):
            try:
                async with self.barrier.exclusive():
                    result = await self.ipc.call(method, body, timeout_s=self.settings.ipc_request_timeout_s)
                return result if isinstance(result, dict) else {}
            except IpcRemoteError as exc:
                log.warning("worker refused %s: %s", method, exc)
                return None
            except IpcTransportError as exc:
                if attempt == RETRY_ATTEMPTS or self._stop.is_set():
                    log.warning("%s failed %d times (%s); the reconciler will retry", method, attempt, exc)
                    return None
                log.info("%s failed (%s); retrying in %.2f s", method, exc, delay)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
        return None

    # ------------------------------------------------------------------ reconciliation
    async def _get_json(self, path: str) -> Any:
        assert self._session is not None and self.replicas is not None
        status, text = await self.replicas.get(self._session, path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {text[:200]}")
        return json.loads(text)

    async def poll_epoch(self) -> bool:
        """One epoch poll; True when a full export is due (epoch or hashes changed, or a rewind)."""
        info = parse_epoch_info(await self._get_json("/v1/configs/epoch"))
        due = info.differs_from(self.last_info) or info.epoch != self.epoch
        if info.epoch < self.epoch:
            log.warning("config service epoch went back from %d to %d: re-syncing", self.epoch, info.epoch)
            self._rewind = True
        self.last_info = info
        return due

    async def reconcile(self) -> str:
        """Full export → ReplaceModelConfigs; returns the outcome (``applied``/``mismatch``/``stale``/…)."""
        export: ConfigExport = parse_export(await self._get_json("/v1/configs/export"))
        async with self._apply_lock:
            rewind = self._rewind
            if export.epoch < self.epoch and not rewind:
                self._count("export_stale")
                return STALE
            models = [
                {"model_id": m.model_id, "model_config": m.raw_yaml or json.dumps(m.config)}
                for m in export.models
                if self.bundle in m.affected_bundles
            ]
            pool_hashes = export.bundle_pool_config_hashes.get(self.bundle, {})
            scoped = self.pool in pool_hashes
            expected = pool_hashes[self.pool] if scoped else export.bundle_config_hashes.get(self.bundle, "")
            body = {
                "bundle_id": self.bundle,
                "epoch": export.epoch,
                "bundle_config_hash": expected,
                "models": models,
                "bundle_adapters": list(export.bundle_adapters.get(self.bundle) or []),
                "pool": self.pool,
                "pool_scoped": scoped,
            }
            resp = await self._call(ipc.REPLACE_MODEL_CONFIGS, body)
            if resp is None:
                self._count(FAILED)
                return FAILED
            outcome = self._commit(
                export.epoch,
                expected,
                resp,
                what=f"export of {len(models)} models",
                allow_empty=True,
                rewind=rewind,
            )
            if outcome == APPLIED:
                self._rewind = False
                self._count("reconciled")
            return outcome

    async def _reconcile_loop(self) -> None:
        s = self.settings
        poll_s = max(0.05, s.worker_config_poll_interval_ms / 1000.0)
        full_s = max(poll_s, s.worker_config_full_export_interval_ms / 1000.0)
        failures = 0
        next_full = 0.0  # at once: the start-up export
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_full or self._reconcile_now.is_set():
                    self._reconcile_now.clear()
                    await self.reconcile()
                    next_full = time.monotonic() + full_s
                elif await self.poll_epoch():
                    await self.reconcile()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - config service down: keep serving, retry
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("config reconcile failed (%d in a row): %s", failures, exc)
                if next_full <= time.monotonic():
                    # retry the start-up export sooner than a full interval
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), min(poll_s, 0.5 * 2 ** min(failures, 4)))
                    continue
            wait = max(0.0, min(poll_s, next_full - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reconcile_now.wait(), wait)
