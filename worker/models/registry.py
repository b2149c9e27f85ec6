"""The runtime's model state machine: absent → loading → loaded | failed, unload and eviction, memory.

The runtime is built in layers, one job per module: :class:`ModelStates` (this module; it also
holds the state every layer shares) → :mod:`worker.models.recovery` (OOM) → :mod:`worker.runtime.executor`
(tokenise and run) → :mod:`worker.runtime.operations` (encode, score, extract) → :mod:`worker.runtime.work_items`
(the sidecar path); :mod:`worker.runtime.control_config` (config deltas) sits beside them on ModelStates.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from protocol import heap
from protocol.adapter_options import loadtime_problems
from protocol.catalog import Catalog, Resolved
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig, model_spec
from worker.adapters.base import Adapter, LoadSpec, Prepared, RequestContext, is_oom
from worker.batching.former import BatchStats
from worker.batching.lanes import lane_plan
from worker.metrics import WorkerMetrics
from worker.models.loaded import (
    ON_LOOP_TIMEOUT_S,
    LoadedModel,
    ModelEntry,
    import_adapter,
    load_signature,
    pick_device,
    tune_process_for_cuda,
)
from worker.models.memory import MemoryManager, cuda_usage, host_usage
from worker.models.weights import Source, WeightCache, WeightsError, weight_bytes
from worker.runtime.results import EnsureResult
from worker.settings import WorkerSettings

log = logging.getLogger("worker.runtime")


class ModelStates:
    def __init__(self, settings: WorkerSettings | None = None, catalog: Catalog | None = None) -> None:
        self.settings = settings or WorkerSettings()
        self.catalog = (
            catalog
            if catalog is not None
            else Catalog.from_dirs(self.settings.models_dir, self.settings.bundles_dir)
        )
        self.device = pick_device(self.settings.device)
        self._entries: dict[tuple, ModelEntry] = {}
        self.cpu_pool = ThreadPoolExecutor(max_workers=self.settings.cpu_workers, thread_name_prefix="cpu")
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self._lora_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-load")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.weights = WeightCache.from_settings(self.settings)
        self.memory = MemoryManager(
            self.memory_usage,
            self.loaded,
            self._evict,
            threshold_percent=self.settings.memory_pressure_threshold_percent,
        )
        self._monitor: asyncio.Task | None = None
        self.recovery_events: deque[tuple[str, str]] = deque(maxlen=256)  # (model, OOM recovery step)
        self.metrics = WorkerMetrics(self)
        self.started_at = time.time()
        self.ready = False
        # Control-plane config state (ApplyModelConfig / ReplaceModelConfigs from the sidecar).
        self._baseline: dict[str, ModelConfig] = {m.sie_id: m for m in self.catalog.models()}
        self._control_adapters: list[str] | None = None  # the bundle's adapters as the config service sees it
        self.unsupported_models: set[str] = set()
        self._importable: dict[str, bool] = {}
        self.on_cuda = self.device.startswith("cuda")
        import torch

        threads = self.settings.torch_threads or torch.get_num_threads()
        # forwards of one model that run at once (worker/batching/lanes.py), and the intra-op threads of each
        self.forward_lanes, lane_threads = lane_plan(self.on_cuda, self.settings.forward_lanes, threads)
        torch.set_num_threads(lane_threads)
        if self.on_cuda:
            tune_process_for_cuda()
        switch_ms = self.settings.gil_switch_interval_ms or (0.5 if self.on_cuda else 0.0)
        if switch_ms:
            # the inference thread launches kernels one Python call at a time; each time it gives
            # up the GIL, a busy tokenising thread keeps it for up to this interval
            sys.setswitchinterval(switch_ms / 1000.0)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.settings.memory_monitor_interval_s > 0:
            self._monitor = self._loop.create_task(
                self.memory.monitor(self.settings.memory_monitor_interval_s), name="memory-monitor"
            )
        for spec in self.settings.preload_list():
            resolved = self.catalog.resolve(spec)
            entry = self._entry(resolved)
            self._start_load(entry, resolved)
            if entry.task:
                await entry.task
            if entry.state != "loaded":
                log.error("preloading %s failed: %s", spec, entry.error.message if entry.error else "?")
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        if self._monitor is not None:
            self._monitor.cancel()
        for entry in list(self._entries.values()):
            if entry.task and not entry.task.done():
                entry.task.cancel()
            if entry.loaded:
                await self._unload(entry)
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._lora_pool.shutdown(wait=False, cancel_futures=True)
        self.weights.close()

    # ---- model states ----------------------------------------------------------------------
    def _entry(self, resolved: Resolved) -> ModelEntry:
        key = load_signature(resolved)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = ModelEntry(key, resolved.model_id)
        return entry

    def loaded_models(self) -> list[str]:
        return sorted({e.model_id for e in self._entries.values() if e.state == "loaded"})

    def loading_models(self) -> list[str]:
        return sorted({e.model_id for e in self._entries.values() if e.state == "loading"})

    def profile_states(self) -> dict[str, tuple[str, str | None]]:
        """Routable name (``M`` or ``M:P``) → (loaded | loading | failed, last load error message) for
        every profile with an instance; what the sidecar's heartbeat tells gateways per profile."""
        out: dict[str, tuple[str, str | None]] = {}
        for model_id in sorted({e.model_id for e in tuple(self._entries.values()) if e.state != "absent"}):
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
            states = [e for e in (self._entries.get(key),) if e is not None]
        else:
            states = [e for e in self._entries.values() if e.model_id == model_id]
        for wanted in ("loaded", "loading", "failed"):
            for e in states:
                if e.state == wanted:
                    err = e.error.detail() if (wanted == "failed" and e.error) else None
                    return wanted, err
        return "available", None

    def loaded(self) -> list[LoadedModel]:
        # a snapshot first: the load and LoRA threads read this while the loop adds entries
        return [e.loaded for e in tuple(self._entries.values()) if e.loaded is not None]

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

    def _start_load(self, entry: ModelEntry, resolved: Resolved) -> None:
        if entry.state == "loading":
            return
        entry.state = "loading"
        entry.attempts += 1
        self._loop = asyncio.get_running_loop()
        entry.task = self._loop.create_task(self._load(entry, resolved), name=f"load:{entry.model_id}")

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
            entry.error = self._load_error(resolved, exc, entry.attempts)
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
        entry.loaded = LoadedModel(self, entry.key, resolved, adapter)
        entry.error = None
        entry.state = "loaded"
        # the model's Python objects (modules, parameters, tokenizer) live until it is unloaded:
        # frozen, a full collection no longer walks them
        heap.freeze()
        load_s = time.monotonic() - started
        self.metrics.model_load_seconds.labels(resolved.model_id).observe(load_s)
        log.info("loading %s… done in %.1f s", resolved.model_id, load_s)
        await self.memory.relieve(keep=entry.key)

    def _build_adapter(self, resolved: Resolved, key: tuple) -> Adapter:
        """Load thread: weights through the cache tiers, room made under memory pressure, then load."""
        problems = loadtime_problems(resolved.profile.adapter_path, resolved.loadtime_options)
        if problems:  # before any download: the config can never load
            raise ValueError("; ".join(message for _, message in problems))
        cls = import_adapter(resolved.profile.adapter_path or "")
        weights = self.weights.resolve_model(resolved.config, protect=self._weight_keys())
        self._on_loop(self.memory.relieve(required_bytes=weight_bytes(weights), keep=key))
        spec = LoadSpec(
            config=resolved.config,
            profile_name=resolved.profile_name,
            weights_dir=str(weights) if weights else None,
            device=self.device,
            precision=resolved.profile.compute_precision or "float32",
            loadtime=resolved.loadtime_options,
        )
        adapter = cls(spec)
        adapter.load()
        return adapter

    def _weight_keys(self) -> set[str]:
        """Cache entries of loaded models: never evicted from the disk cache."""
        return {Source.of_model(lm.resolved.config).key for lm in self.loaded()}  # (any thread)

    def resolve_lora(self, name: str) -> Path:
        """Loader thread: a LoRA named by a local directory (absolute, ``./`` or ``~``) or a hub id."""
        if name.startswith(("/", "./", "../", "~")):
            path = Path(name).expanduser()
            if not path.is_dir():
                raise WeightsError(f"LoRA directory {name} does not exist")
            return path
        return self.weights.resolve(Source(ident=name, hub_id=name), protect=self._weight_keys())

    def _on_loop(self, coro) -> Any:
        """From a worker thread: run a coroutine on the event loop and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=ON_LOOP_TIMEOUT_S)

    def forward_with_recovery(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """One forward pass with OOM recovery, on an inference lane: see worker.models.recovery."""
        raise NotImplementedError

    # ---- memory ----------------------------------------------------------------------------
    def memory_usage(self) -> tuple[int, int]:
        """(used, total) bytes: the synthetic budget when set, else the CUDA device or the host."""
        budget = self.settings.memory_budget_bytes
        if budget > 0:
            return sum(lm.memory_bytes() for lm in self.loaded()), budget
        if self.device.startswith("cuda"):
            return cuda_usage(self.device)
        return host_usage()

    async def _evict(self, key: Hashable) -> None:
        entry = self._entries.get(key) if isinstance(key, tuple) else None
        if entry is not None and entry.loaded is not None:
            await self._unload(entry)

    def _load_error(self, resolved: Resolved, exc: Exception, attempts: int) -> SIEError:
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

    async def _unload(self, entry: ModelEntry) -> None:
        lm = entry.loaded
        if lm is None:
            return
        entry.loaded = None
        entry.state = "absent"
        lm.closed = True
        lm.loras.close()
        await lm.former.close(
            SIEError(
                ErrorCode.MODEL_LOADING,
                f"Model '{lm.model_id}' was unloaded; retry",
                retry_after=self.settings.model_loading_retry_after_s,
            )
        )
        await lm.alone(lm.adapter.unload)
        lm.executor.shutdown(wait=False)
        heap.unfreeze()  # loads freeze the heap: the model's objects must be visible to the collector
        self._clear_device_cache()
        log.info("unloaded %s", lm.model_id)

    def _clear_device_cache(self) -> None:
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def _evict_sibling(self, keep: LoadedModel) -> bool:
        """From an inference lane: the memory manager unloads the least recently used other model."""
        if self._loop is None:
            return False
        try:
            victim = self._on_loop(self.memory.evict_lru(keep=keep.key))
        except Exception:
            log.exception("evicting a sibling of %s failed", keep.model_id)
            return False
        if victim is None:
            return False
        log.warning("evicted %s to recover from OOM in %s", victim[0], keep.model_id)
        return True

    async def _ready_model(self, resolved: Resolved) -> LoadedModel:
        entry = self._entry(resolved)
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
        entry = self._entry(resolved)
        before = entry.state
        try:
            lm = await self._ready_model(resolved)
        except SIEError as exc:
            if exc.code == ErrorCode.MODEL_LOAD_FAILED:
                return EnsureResult("failed", exc)
            return EnsureResult("loading_in_progress" if before == "loading" else "loading_started", exc)
        return EnsureResult("ready", None, lm.max_cost, lm.max_requests, lm.forwards_in_flight, lm.lanes)
