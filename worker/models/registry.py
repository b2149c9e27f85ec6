"""The model state machine: absent → loading → loaded | failed, per load signature.

The registry loads models into the :class:`~worker.models.table.ModelTable` on a load thread
(weights through the cache tiers, room made under memory pressure first), answers what state each
model is in, and hands the runtime a loaded model or the error a request gets meanwhile
(``MODEL_LOADING`` with Retry-After, or the load's failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import heap
from protocol.adapter_options import loadtime_problems
from protocol.catalog import Catalog, Resolved
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig, model_spec
from worker.adapters.base import Adapter, LoadSpec, is_oom
from worker.batching.former import BatchStats
from worker.metrics import WorkerMetrics
from worker.models.loaded import (
    ForwardFn,
    LoadedModel,
    ModelEntry,
    ModelEnv,
    ModelKey,
    import_adapter,
    load_signature,
)
from worker.models.loop_bridge import LoopBridge
from worker.models.lora import resolve_declared
from worker.models.memory import MemoryManager
from worker.models.placement import Placement
from worker.models.precision import load_precision
from worker.models.table import ModelTable
from worker.models.weights import Source, WeightCache, WeightsError, weight_bytes
from worker.settings import WorkerSettings

log = logging.getLogger("worker.runtime")


@dataclass
class EnsureResult:
    """The sidecar's answer about one model (EnsureModelReady)."""

    state: str  # ready | loading_started | loading_in_progress | failed
    error: SIEError | None = None
    max_batch_tokens: int = 0
    max_batch_requests: int = 0
    forwards_in_flight: int = 0  # batches handed to the model's forward threads at once
    forward_threads: int = 0  # forwards of the model that run at once (worker/batching/forward_threads.py)


class ModelRegistry:
    def __init__(
        self,
        settings: WorkerSettings,
        catalog: Catalog,
        *,
        placement: Placement,
        table: ModelTable,
        memory: MemoryManager,
        weights: WeightCache,
        loop: LoopBridge,
        metrics: WorkerMetrics,
        forward: ForwardFn,
    ) -> None:
        """``forward``: every loaded model's forward pass, OOM recovery included."""
        self.settings = settings
        self.catalog = catalog
        self.table = table
        self.memory = memory
        self.weights = weights
        self.loop = loop
        self.metrics = metrics
        self.placement = placement
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self._lora_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-load")
        self.env = ModelEnv(settings, placement, metrics, forward, self.resolve_lora, self._lora_pool)
        self.monitor: asyncio.Task[None] | None = None  # the memory manager's pressure checks
        self.idle_task: asyncio.Task[None] | None = None  # the idle unload (SIE_MODEL_IDLE_TIMEOUT_S)
        self.static_pins = list(settings.pinned_list())  # SIE_PINNED_MODELS
        self.pool_pins: list[str] = []  # the pinned models of the pools this worker serves (sidecar)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the loop, start the memory monitor, load ``SIE_PRELOAD_MODELS`` one after another."""
        self.loop.bind()
        if self.settings.memory_monitor_interval_s > 0:
            self.monitor = asyncio.get_running_loop().create_task(
                self.memory.monitor(self.settings.memory_monitor_interval_s), name="memory-monitor"
            )
        if self.settings.model_idle_timeout_s > 0:
            self.idle_task = asyncio.get_running_loop().create_task(
                self._unload_idle_forever(), name="idle-unload"
            )
        self.set_pins(self.static_pins, [])
        for spec in [*self.settings.preload_list(), *self.static_pins]:
            resolved = self.catalog.resolve(spec)
            entry = self.table.entry(resolved)
            self._start_load(entry, resolved)
            if entry.task:
                await entry.task
            if entry.state != "loaded":
                log.error("preloading %s failed: %s", spec, entry.error.message if entry.error else "?")

    async def close(self) -> None:
        for task in (self.monitor, self.idle_task):
            if task is not None:
                task.cancel()
        for entry in self.table.entries():
            if entry.task and not entry.task.done():
                entry.task.cancel()
            if entry.loaded:
                await self.table.unload(entry)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._lora_pool.shutdown(wait=False, cancel_futures=True)
        self.weights.close()

    # ---- pinned models and the idle unload --------------------------------------------------
    def set_pins(self, static: list[str], pools: list[str]) -> list[str]:
        """Pin ``static`` (SIE_PINNED_MODELS) and ``pools`` (the pools' ``pinned_models``, from the
        sidecar): each is kept loaded — loads start now — and is never evicted or idle-unloaded.
        Specs that do not resolve here are skipped. Returns the pinned routable names."""
        self.pool_pins = list(pools)
        keys = set()
        names = []
        for spec in dict.fromkeys([*static, *pools]):
            try:
                resolved = self.catalog.resolve(spec)
            except SIEError:
                log.warning("pinned model %s is not in this worker's catalog; not pinned", spec)
                continue
            entry = self.table.entry(resolved)
            keys.add(entry.key)
            names.append(spec)
            if entry.state == "absent" or (entry.state == "failed" and not self._failure_stands(entry)):
                with contextlib.suppress(RuntimeError):  # no running loop: start() loads them
                    self._start_load(entry, resolved)
        if keys != self.table.pinned:
            log.info("pinned models: %s", ", ".join(names) or "none")
        self.table.pinned = keys
        return names

    def pinned_models(self) -> list[str]:
        return sorted({e.model_id for e in self.table.entries() if e.key in self.table.pinned})

    def _failure_stands(self, entry: ModelEntry) -> bool:
        cooling = time.monotonic() - entry.failed_at < self.settings.load_failure_cooldown_s
        return bool(entry.error is not None and (entry.error.extra.get("permanent", True) or cooling))

    async def unload_idle(self) -> list[str]:
        """Unload every loaded model that is not pinned, has nothing queued or running, and has had
        no request for ``SIE_MODEL_IDLE_TIMEOUT_S``; returns their model ids. A model loaded on
        demand that has not served yet gets two Retry-After periods more: the request that started
        its load comes back after one."""
        timeout = self.settings.model_idle_timeout_s
        grace = 2 * self.settings.model_loading_retry_after_s
        now = time.monotonic()
        unloaded = []
        for entry in self.table.entries():
            lm = entry.loaded
            if lm is None or entry.key in self.table.pinned or lm.former.busy:
                continue
            if now - lm.last_used_at >= timeout + (0 if lm.used else grace):
                log.info("unloading %s: idle for %.0f s", lm.model_id, now - lm.last_used_at)
                async with self.memory.lock:
                    await self.table.unload(entry)
                self.metrics.idle_unloads.labels(lm.model_id).inc()
                unloaded.append(lm.model_id)
        return unloaded

    async def _unload_idle_forever(self) -> None:
        interval = min(max(self.settings.model_idle_timeout_s / 4, 0.1), 10.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.unload_idle()
            except Exception:
                log.exception("idle unload pass failed")

    # ---- states ----------------------------------------------------------------------------
    def entry(self, resolved: Resolved) -> ModelEntry:
        return self.table.entry(resolved)

    def loaded(self) -> list[LoadedModel]:
        return self.table.loaded()

    def loaded_models(self) -> list[str]:
        return sorted({e.model_id for e in self.table.entries() if e.state == "loaded"})

    def loading_models(self) -> list[str]:
        return sorted({e.model_id for e in self.table.entries() if e.state == "loading"})

    def profile_states(self) -> dict[str, tuple[str, str | None]]:
        """Routable name (``M`` or ``M:P``) → (loaded | loading | failed, last load error message) for
        every profile with an instance; what the sidecar's heartbeat tells gateways per profile."""
        out: dict[str, tuple[str, str | None]] = {}
        for model_id in sorted({e.model_id for e in self.table.entries() if e.state != "absent"}):
            config = self.catalog.get(model_id)
            if config is None:
                continue
            for name in sorted(config.profiles):
                state, err = self.model_state(model_id, name)
                if state != "available":
                    message = str(err.get("message", ""))[:500] if err else None
                    out[model_spec(model_id, name)] = (state, message)
        return out

    def model_state(self, model_id: str, profile: str | None = None) -> tuple[str, dict[str, Any] | None]:
        """(state, last_error) of a model, or of one profile's loaded instance, for /v1/models.

        For a whole model: loaded > loading > failed > available over its instances.
        """
        if (
            profile is not None
            and (config := self.catalog.get(model_id)) is not None
            and profile in config.profiles
        ):
            key = load_signature(Resolved(config, profile, config.resolved_profile(profile)))
            states = [e for e in (self.table.get(key),) if e is not None]
        else:
            states = [e for e in self.table.entries() if e.model_id == model_id]
        for wanted in ("loaded", "loading", "failed"):
            for e in states:
                if e.state == wanted:
                    err = e.error.detail() if (wanted == "failed" and e.error) else None
                    return wanted, err
        return "available", None

    def loaded_precision(self, model_id: str, profile: str) -> str | None:
        """The precision a profile's loaded instance computes in (what it loaded with, after
        ``SIE_CPU_PRECISION``), for /v1/models; None while it is not loaded."""
        config = self.catalog.get(model_id)
        if config is None or profile not in config.profiles:
            return None
        entry = self.table.get(load_signature(Resolved(config, profile, config.resolved_profile(profile))))
        return entry.loaded.adapter.spec.precision if entry is not None and entry.loaded is not None else None

    def batch_stats(self) -> BatchStats:
        total = BatchStats()
        for lm in self.loaded():
            s = lm.stats
            total.forwards += s.forwards
            total.units += s.units
            total.real_tokens += s.real_tokens
            total.padded_tokens += s.padded_tokens
        return total

    def queue_depth(self) -> int:
        return sum(lm.former.depth for lm in self.loaded())

    # ---- the runtime's way in --------------------------------------------------------------
    async def ready_model(self, resolved: Resolved) -> LoadedModel:
        """The loaded model of ``resolved``; else its load starts (or its failure stands) and the
        request is answered MODEL_LOADING (or the failure)."""
        entry = self.table.entry(resolved)
        if entry.state == "loaded" and entry.loaded is not None:
            entry.loaded.touch()
            return entry.loaded
        if entry.state == "failed" and entry.error is not None:
            cooling = time.monotonic() - entry.failed_at < self.settings.load_failure_cooldown_s
            if entry.error.extra.get("permanent", True) or cooling:
                raise entry.error
        self._start_load(entry, resolved)
        raise SIEError(
            ErrorCode.MODEL_LOADING,
            f"Model '{resolved.model_id}' is loading; retry shortly",
            retry_after=self.settings.model_loading_retry_after_s,
        )

    async def ensure_ready(self, spec: str) -> EnsureResult:
        """For the sidecar: the model's state, starting a load when it is not loaded."""
        try:
            resolved = self.catalog.resolve(spec)
        except SIEError as exc:
            return EnsureResult("failed", exc)
        entry = self.table.entry(resolved)
        before = entry.state
        try:
            lm = await self.ready_model(resolved)
        except SIEError as exc:
            if exc.code == ErrorCode.MODEL_LOAD_FAILED:
                return EnsureResult("failed", exc)
            return EnsureResult("loading_in_progress" if before == "loading" else "loading_started", exc)
        return EnsureResult(
            "ready", None, lm.max_cost, lm.max_requests, lm.forwards_in_flight, lm.forward_threads
        )

    async def drop_stale(self, model_id: str) -> None:
        """Unload (or forget) the model's entries whose load-time state differs from the catalog's."""
        config = self.catalog.get(model_id)
        current: dict[ModelKey, ModelConfig] = {}
        if config is not None:
            for name in config.profiles:
                try:
                    current[load_signature(Resolved(config, name, config.resolved_profile(name)))] = config
                except Exception:  # noqa: BLE001 - an unresolvable profile has no valid entry
                    continue
        model_fields = config.model_dump(exclude={"profiles"}) if config is not None else None
        for entry in self.table.entries():
            if entry.model_id != model_id:
                continue
            loaded_fields = (
                entry.loaded.resolved.config.model_dump(exclude={"profiles"})
                if entry.loaded
                else model_fields
            )
            if entry.key in current and loaded_fields == model_fields and entry.state != "failed":
                continue
            log.info("config of %s changed: dropping its %s entry %s", model_id, entry.state, entry.key[1:])
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()
            if entry.loaded is not None:
                await self.table.unload(entry)
            self.table.forget(entry.key)

    # ---- loading ---------------------------------------------------------------------------
    def _start_load(self, entry: ModelEntry, resolved: Resolved) -> None:
        if entry.state == "loading":
            return
        entry.state = "loading"
        entry.attempts += 1
        self.loop.bind()
        entry.task = asyncio.get_running_loop().create_task(
            self._load(entry, resolved), name=f"load:{entry.model_id}"
        )

    async def _load(self, entry: ModelEntry, resolved: Resolved) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        log.info(
            "loading %s (profile %s, attempt %d)…", resolved.model_id, resolved.profile_name, entry.attempts
        )
        try:
            adapter = await loop.run_in_executor(self._load_pool, self._build_adapter, resolved, entry.key)
        except asyncio.CancelledError:
            entry.state = "absent"
            raise
        except Exception as exc:
            entry.error = load_error(resolved, exc, entry.attempts)
            entry.state = "failed"
            entry.failed_at = time.monotonic()
            self.metrics.model_load_failures.labels(resolved.model_id).inc()
            log.error(
                "loading %s… failed after %.1f s: %s",
                resolved.model_id,
                time.monotonic() - started,
                entry.error.message,
            )
            return
        entry.loaded = LoadedModel(entry.key, resolved, adapter, self.env)
        entry.error = None
        entry.state = "loaded"
        # the model's Python objects (modules, parameters, tokenizer) live until it is unloaded:
        # frozen, a full collection no longer walks them
        heap.freeze()
        load_s = time.monotonic() - started
        self.metrics.model_load_seconds.labels(resolved.model_id).observe(load_s)
        asked = resolved.profile.compute_precision or "float32"
        log.info(
            "loading %s… done in %.1f s: %s on %s%s",
            resolved.model_id,
            load_s,
            adapter.spec.precision,
            adapter.spec.device,
            "" if adapter.spec.precision == asked else f" (the profile asks {asked}; SIE_CPU_PRECISION)",
        )
        await self.memory.relieve(keep=entry.key)

    def _build_adapter(self, resolved: Resolved, key: ModelKey) -> Adapter:
        """Load thread: weights through the cache tiers, room made under memory pressure, then load."""
        problems = loadtime_problems(resolved.profile.adapter_path, resolved.loadtime_options)
        if problems:  # before any download: the config can never load
            raise ValueError("; ".join(message for _, message in problems))
        cls = import_adapter(resolved.profile.adapter_path or "")
        weights = self.weights.resolve_model(resolved.config, protect=self.weight_keys())
        self.loop.run(self.memory.relieve(required_bytes=weight_bytes(weights), keep=key))
        spec = LoadSpec(
            config=resolved.config,
            profile_name=resolved.profile_name,
            weights_dir=str(weights) if weights else None,
            device=self.placement.device,
            precision=load_precision(
                resolved.profile.compute_precision, cls, self.placement.device, self.settings.cpu_precision
            ),
            loadtime=resolved.loadtime_options,
        )
        adapter = cls(spec)
        adapter.load()
        return adapter

    def weight_keys(self) -> set[str]:
        """Cache entries of loaded models: never evicted from the disk cache (any thread)."""
        return {Source.of_model(lm.resolved.config).key for lm in self.loaded()}

    def resolve_lora(self, config: ModelConfig, name: str) -> Path:
        """Loader thread: the directory of the LoRA ``name`` that ``config`` declares (only a declared
        entry: a name is never a path or a hub id; see :func:`worker.models.lora.resolve_declared`)."""
        return resolve_declared(
            config, name, self.weights, max_bytes=self.settings.max_lora_bytes, protect=self.weight_keys()
        )


def load_error(resolved: Resolved, exc: Exception, attempts: int) -> SIEError:
    """What a failed load answers: MODEL_LOAD_FAILED, classified (and whether retrying can help)."""
    if isinstance(exc, WeightsError):
        error_class, permanent = exc.error_class, exc.permanent
    elif isinstance(exc, ImportError):
        error_class, permanent = "DEPENDENCY", True
    elif is_oom(exc):
        error_class, permanent = "OOM", False
    else:
        error_class, permanent = "CONFIG", True
    return SIEError(
        ErrorCode.MODEL_LOAD_FAILED,
        f"Model '{resolved.model_id}' failed to load: {exc}",
        error_class=error_class,
        permanent=permanent,
        attempts=attempts,
    )
