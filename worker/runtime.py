"""The model runtime: a plain Python API over loaded models, used by both front doors.

``encode``/``score``/``extract`` take decoded request pieces and return response pieces; with
``direct=False`` (standalone HTTP) items go through the model's BatchFormer and share forward
passes with concurrent requests; with ``direct=True`` (sidecar path, which has already batched)
they run at once. ``run_work_items`` executes a batch of NATS work items for the IPC front door.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import importlib.util
import itertools
import json
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.catalog import Catalog, Resolved
from protocol.codec import packb
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.model_config import Bundle, ModelConfig, bundle_config_hash
from protocol.work import WorkItem, WorkResult
from worker.adapters.base import Adapter, LoadSpec, Prepared, RequestContext, is_oom
from worker.batching import BatchFormer, BatchInfo, BatchStats, chunk_by_cost
from worker.lora import LoraSet
from worker.memory import MemoryManager, cuda_usage, host_usage
from worker.plans import Plan, plan_encode, plan_extract, plan_score
from worker.postprocess import encode_item
from worker.settings import WorkerSettings
from worker.weights import Source, WeightCache, WeightsError, weight_bytes

log = logging.getLogger(__name__)

MAX_SPLIT_DEPTH = 4

ON_LOOP_TIMEOUT_S = 300.0  # a worker thread waiting on the loop (evictions) never hangs past this
_use_clock = itertools.count(1)  # orders models by last use (the memory manager's LRU)


def pick_device(setting: str) -> str:
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EnsureResult:
    state: str  # ready | loading_started | loading_in_progress | failed
    error: SIEError | None = None
    max_batch_tokens: int = 0
    max_batch_requests: int = 0


@dataclass
class Timing:
    queue_ms: float = 0.0
    tokenization_ms: float = 0.0
    inference_ms: float = 0.0
    postprocessing_ms: float = 0.0
    total_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "total_ms": round(self.total_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "tokenization_ms": round(self.tokenization_ms, 3),
            "inference_ms": round(self.inference_ms, 3),
            "postprocessing_ms": round(self.postprocessing_ms, 3),
        }


@dataclass
class Result:
    """What one request produced: per-item outputs (or score entries), timing and token usage."""

    items: list[Any]
    timing: Timing
    input_tokens: int = 0
    query_id: str | None = None


class LoadedModel:
    """A loaded adapter with its own inference thread and batcher."""

    def __init__(self, runtime: Runtime, key: tuple, resolved: Resolved, adapter: Adapter) -> None:
        self.key = key
        self.model_id = resolved.model_id
        self.resolved = resolved
        self.adapter = adapter
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-{resolved.model_id}")
        s = runtime.settings
        self.max_cost = min(s.max_batch_cost, resolved.profile.max_batch_tokens or s.max_batch_cost)
        self.max_requests = s.max_batch_requests
        self.stats = BatchStats()
        self.last_used = next(_use_clock)
        self.closed = False
        self._runtime = runtime
        loop = asyncio.get_running_loop()
        self.loras = LoraSet(
            resolved.model_id,
            adapter,
            max_loras=s.max_loras_per_model,
            resolve=runtime.resolve_lora,
            resolve_pool=runtime._lora_pool,
            on_inference_thread=lambda fn, *args: loop.run_in_executor(self.executor, fn, *args),
            retry_after_s=s.lora_loading_retry_after_s,
            failure_cooldown_s=s.load_failure_cooldown_s,
        )
        self.former = BatchFormer(
            self.run,
            max_cost=self.max_cost,
            max_requests=self.max_requests,
            max_wait_ms=s.max_batch_wait_ms,
            coalesce_ms=s.batch_coalesce_ms,
            max_pad_share=s.max_padding_share,
            in_flight=s.forwards_in_flight or (2 if runtime.on_cuda else 1),
            name=resolved.model_id,
        )

    async def run(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """One forward pass (with OOM recovery) on this model's inference thread."""
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self.executor, self._runtime.forward_with_recovery, self, ctx, units)
        if self.adapter.token_costed:
            self.stats.record(units)
        return outputs

    def touch(self) -> None:
        self.last_used = next(_use_clock)

    def memory_bytes(self) -> int:
        return self.adapter.memory_bytes()


@dataclass
class _Entry:
    key: tuple
    model_id: str
    state: str = "absent"  # absent | loading | loaded | failed
    loaded: LoadedModel | None = None
    task: asyncio.Task | None = None
    error: SIEError | None = None
    attempts: int = 0
    failed_at: float = 0.0
    waiters: list[asyncio.Future] = field(default_factory=list)


def load_signature(resolved: Resolved) -> tuple:
    """Profiles with the same adapter, precision and load-time options share one loaded model."""
    prof = resolved.profile
    return (
        resolved.model_id,
        prof.adapter_path,
        prof.compute_precision or "float32",
        json.dumps(resolved.loadtime_options, sort_keys=True, default=str),
    )


def import_adapter(path: str) -> type[Adapter]:
    module_name, _, cls_name = path.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ImportError(f"{path} is not an Adapter class")
    return cls


def tune_process_for_cuda() -> None:
    """Process-wide CUDA choices for serving: no attention backend that compiles per shape.

    PyTorch's SDPA picks cuDNN attention for half precision, and cuDNN builds a plan for every new
    (batch, width) shape: tens to hundreds of milliseconds on the hot path of mixed traffic.
    """
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


class Runtime:
    def __init__(self, settings: WorkerSettings | None = None, catalog: Catalog | None = None) -> None:
        self.settings = settings or WorkerSettings()
        self.catalog = catalog or Catalog.from_dirs(self.settings.models_dir, self.settings.bundles_dir)
        self.device = pick_device(self.settings.device)
        self._entries: dict[tuple, _Entry] = {}
        self.cpu_pool = ThreadPoolExecutor(max_workers=self.settings.cpu_workers, thread_name_prefix="cpu")
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self._lora_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-load")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.weights = WeightCache.from_settings(self.settings)
        self.memory = MemoryManager(
            self.memory_usage, self.loaded, self._evict,
            threshold_percent=self.settings.memory_pressure_threshold_percent,
        )
        self._monitor: asyncio.Task | None = None
        self.recovery_events: deque[tuple[str, str]] = deque(maxlen=256)  # (model, OOM recovery step)
        self.started_at = time.time()
        self.ready = False
        # Control-plane config state (ApplyModelConfig / ReplaceModelConfigs from the sidecar).
        self._baseline: dict[str, ModelConfig] = {m.sie_id: m for m in self.catalog.models()}
        self._control_adapters: list[str] | None = None  # the bundle's adapters as the config service sees it
        self.unsupported_models: set[str] = set()
        self._importable: dict[str, bool] = {}
        if self.settings.torch_threads > 0:
            import torch

            torch.set_num_threads(self.settings.torch_threads)
        self.on_cuda = self.device.startswith("cuda")
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
    def _entry(self, resolved: Resolved) -> _Entry:
        key = load_signature(resolved)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key, resolved.model_id)
        return entry

    def loaded_models(self) -> list[str]:
        return sorted({e.model_id for e in self._entries.values() if e.state == "loaded"})

    def loading_models(self) -> list[str]:
        return sorted({e.model_id for e in self._entries.values() if e.state == "loading"})

    def model_state(self, model_id: str, profile: str | None = None) -> tuple[str, dict[str, Any] | None]:
        """(state, last_error) of a model, or of one profile's loaded instance, for /v1/models.

        For a whole model: loaded > loading > failed > available over its instances.
        """
        if profile is not None and (config := self.catalog.get(model_id)) is not None and profile in config.profiles:
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

    def _start_load(self, entry: _Entry, resolved: Resolved) -> None:
        if entry.state == "loading":
            return
        entry.state = "loading"
        entry.attempts += 1
        self._loop = asyncio.get_running_loop()
        entry.task = self._loop.create_task(self._load(entry, resolved), name=f"load:{entry.model_id}")

    async def _load(self, entry: _Entry, resolved: Resolved) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        log.info("loading %s (profile %s, attempt %d)", resolved.model_id, resolved.profile_name, entry.attempts)
        try:
            adapter = await loop.run_in_executor(self._load_pool, self._build_adapter, resolved, entry.key)
        except asyncio.CancelledError:
            entry.state = "absent"
            raise
        except Exception as exc:
            entry.error = self._load_error(resolved, exc, entry.attempts)
            entry.state = "failed"
            entry.failed_at = time.monotonic()
            log.error("loading %s failed: %s", resolved.model_id, entry.error.message)
            return
        entry.loaded = LoadedModel(self, entry.key, resolved, adapter)
        entry.error = None
        entry.state = "loaded"
        log.info("loaded %s in %.1f s", resolved.model_id, time.monotonic() - started)
        await self.memory.relieve(keep=entry.key)

    def _build_adapter(self, resolved: Resolved, key: tuple) -> Adapter:
        """Load thread: weights through the cache tiers, room made under memory pressure, then load."""
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
        entry = self._entries.get(key)  # type: ignore[arg-type]
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

    async def _unload(self, entry: _Entry) -> None:
        lm = entry.loaded
        if lm is None:
            return
        entry.loaded = None
        entry.state = "absent"
        lm.closed = True
        lm.loras.close()
        await lm.former.close(
            SIEError(ErrorCode.MODEL_LOADING, f"Model '{lm.model_id}' was unloaded; retry",
                     retry_after=self.settings.model_loading_retry_after_s)
        )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(lm.executor, lm.adapter.unload)
        lm.executor.shutdown(wait=False)
        self._clear_device_cache()
        log.info("unloaded %s", lm.model_id)

    async def unload_model(self, model_id: str) -> bool:
        done = False
        for entry in list(self._entries.values()):
            if entry.model_id == model_id and entry.loaded:
                await self._unload(entry)
                done = True
        return done

    def _clear_device_cache(self) -> None:
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def _evict_sibling(self, keep: LoadedModel) -> bool:
        """From an inference thread: the memory manager unloads the least recently used other model."""
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
        return EnsureResult("ready", None, lm.max_cost, lm.max_requests)

    # ---- execution -------------------------------------------------------------------------
    def forward_with_recovery(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """Inference thread: forward; on OOM clear caches, evict a sibling, split; then give up.

        Each step taken is recorded in ``recovery_events`` as (model, step): ``oom``,
        ``cache_clear``, ``evict_sibling``, ``split``, ``exhausted``.
        """
        if lm.closed:
            raise SIEError(ErrorCode.MODEL_LOADING, f"Model '{lm.model_id}' was unloaded; retry",
                           retry_after=self.settings.model_loading_retry_after_s)
        try:
            return lm.adapter.forward(ctx, units)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._recovery(lm, "oom")
            if self.settings.disable_oom_recovery:
                raise self._exhausted(lm) from exc
        log.warning("OOM in %s on a batch of %d; recovering", lm.model_id, len(units))
        self._recovery(lm, "cache_clear")
        self._clear_device_cache()
        try:
            return lm.adapter.forward(ctx, units)
        except Exception as exc:
            if not is_oom(exc):
                raise
        if self._evict_sibling(lm):
            self._recovery(lm, "evict_sibling")
            try:
                return lm.adapter.forward(ctx, units)
            except Exception as exc:
                if not is_oom(exc):
                    raise
        return self._split(lm, ctx, units, 1)

    def _recovery(self, lm: LoadedModel, step: str) -> None:
        self.recovery_events.append((lm.model_id, step))

    def _split(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared], depth: int) -> list[Any]:
        """Halve the batch recursively (at most MAX_SPLIT_DEPTH levels) until the halves fit."""
        if len(units) < 2 or depth > MAX_SPLIT_DEPTH:
            self._recovery(lm, "exhausted")
            raise self._exhausted(lm)
        self._recovery(lm, "split")
        half = len(units) // 2
        out = []
        for part in (units[:half], units[half:]):
            try:
                out.extend(lm.adapter.forward(ctx, part))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self._clear_device_cache()
                out.extend(self._split(lm, ctx, part, depth + 1))
        return out

    def _exhausted(self, lm: LoadedModel) -> SIEError:
        return SIEError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"Out of memory running '{lm.model_id}' after recovery; retry later",
            retry_after=self.settings.resource_exhausted_retry_after_s,
        )

    async def _ensure_lora(self, lm: LoadedModel, lora: str | None) -> None:
        """A request naming a LoRA needs a model that supports them, and the LoRA loaded (else 503)."""
        if not lora:
            return
        if not lm.adapter.supports_lora:
            raise invalid_input(f"Model '{lm.model_id}' does not support LoRA adapters", param="lora")
        lm.loras.ensure(lora)

    async def _prepare(self, lm: LoadedModel, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        loop = asyncio.get_running_loop()
        step = 64
        if len(inputs) <= step:
            return await loop.run_in_executor(self.cpu_pool, lm.adapter.prepare, ctx, inputs)
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self.cpu_pool, lm.adapter.prepare, ctx, inputs[i : i + step])
                for i in range(0, len(inputs), step)
            )
        )
        return [u for part in parts for u in part]

    async def _infer(self, lm: LoadedModel, ctx: RequestContext, inputs: list[Any], direct: bool,
                     timing: Timing) -> tuple[list[Prepared], list[Any]]:
        """Tokenise ``inputs`` (CPU pool) and run them (batcher, or at once when ``direct``).

        On the batched path the request is announced to the model's BatchFormer before it
        tokenises, so a batch about to run waits for it briefly instead of running without it.
        """
        await self._ensure_lora(lm, ctx.lora)
        if not direct:
            lm.former.expect()
        t = time.monotonic()
        try:
            units = await self._prepare(lm, ctx, inputs)
        except BaseException:
            if not direct:
                lm.former.unexpect()
            raise
        timing.tokenization_ms = (time.monotonic() - t) * 1000
        with lm.loras.use(ctx.lora):
            outputs = await self._execute(lm, ctx, units, direct, timing)
        return units, outputs

    async def _execute(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared], direct: bool,
                       timing: Timing) -> list[Any]:
        if ctx.op not in lm.adapter.operations:
            if not direct:
                lm.former.unexpect()
            raise invalid_input(f"Model '{lm.model_id}' does not support {ctx.op}")
        submitted = time.monotonic()
        if direct:
            outputs: list[Any] = [None] * len(units)
            for chunk in chunk_by_cost(units, lm.max_cost, lm.max_requests, self.settings.max_padding_share):
                started = time.monotonic()
                outs = await lm.run(ctx, [units[i] for i in chunk])
                timing.queue_ms = max(timing.queue_ms, (started - submitted) * 1000)
                timing.inference_ms += (time.monotonic() - started) * 1000
                for i, out in zip(chunk, outs, strict=True):
                    outputs[i] = out
            return outputs
        futures = lm.former.submit(ctx, units, expected=True)
        try:
            results = await asyncio.gather(*futures)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        seen: dict[int, BatchInfo] = {}
        for _, info in results:
            seen[id(info)] = info
        if seen:
            timing.queue_ms = max((i.started - submitted) * 1000 for i in seen.values())
            timing.inference_ms = sum(i.inference_ms for i in seen.values())
        return [out for out, _ in results]

    async def _postprocess(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)

    def _check_items(self, resolved: Resolved, items: list[dict[str, Any]]) -> None:
        limit = self.settings.max_item_text_bytes
        text_model = resolved.config.inputs.text
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise invalid_input(f"Item {i} must be a map", param=f"items.{i}")
            for media in ("images", "audio", "video", "document"):
                if item.get(media) and not getattr(resolved.config.inputs, "image" if media == "images" else media):
                    raise invalid_input(
                        f"Model '{resolved.routable_id}' does not accept {media} input", param=f"items.{i}.{media}"
                    )
            text = item.get("text")
            if text is not None and not isinstance(text, str):
                raise invalid_input(f"Item {i}: text must be a string", param=f"items.{i}.text")
            if text_model and text is None and not any(item.get(m) for m in ("images", "audio", "video", "document")):
                raise invalid_input(f"Item {i} has no text", param=f"items.{i}.text")
            if text is not None and len(text.encode("utf-8")) > limit:
                raise invalid_input(f"Item {i}: text is larger than {limit} bytes", param=f"items.{i}.text")

    # ---- public operations -----------------------------------------------------------------
    async def encode(self, spec: str, items: list[dict[str, Any]], params: dict[str, Any] | None = None,
                     *, direct: bool = False) -> Result:
        t0 = time.monotonic()
        params = params or {}
        options = params.get("options") or {}
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_encode(resolved, params)
        return await self.encode_plan(plan, items, direct=direct, t0=t0)

    async def encode_plan(self, plan: Plan, items: list[dict[str, Any]], *, direct: bool, t0: float) -> Result:
        self._check_items(plan.resolved, items)
        lm = await self._ready_model(plan.resolved)
        timing = Timing()
        units, raws = await self._infer(lm, plan.ctx, items, direct, timing)
        t = time.monotonic()
        out = await self._postprocess(self._encode_outputs, plan, raws, items)
        timing.postprocessing_ms = (time.monotonic() - t) * 1000
        timing.total_ms = (time.monotonic() - t0) * 1000
        return Result(out, timing, sum(u.input_tokens for u in units))

    def _encode_outputs(self, plan: Plan, raws: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict]:
        from worker.postprocessors import apply_postprocessors

        raws = apply_postprocessors(plan, raws)
        return [encode_item(raw, plan.output_dtype, plan.dims, item.get("id")) for raw, item in zip(raws, items, strict=True)]

    async def score(self, spec: str, query: dict[str, Any], items: list[dict[str, Any]],
                    instruction: Any = None, options: dict[str, Any] | None = None,
                    *, direct: bool = False) -> Result:
        t0 = time.monotonic()
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_score(resolved, instruction, options)
        if not items:
            raise invalid_input("Field 'items' must not be empty", param="items")
        if len(items) > self.settings.max_score_items:
            raise invalid_input(f"At most {self.settings.max_score_items} items can be scored at once", param="items")
        self._check_items(resolved, [query, *items])
        lm = await self._ready_model(resolved)
        timing = Timing()
        units, scores = await self._infer(lm, plan.ctx, [(query, item) for item in items], direct, timing)
        t = time.monotonic()
        entries = rank_scores(scores, items)
        timing.postprocessing_ms = (time.monotonic() - t) * 1000
        timing.total_ms = (time.monotonic() - t0) * 1000
        return Result(entries, timing, sum(u.input_tokens for u in units), query_id=query.get("id"))

    async def extract(self, spec: str, items: list[dict[str, Any]], params: dict[str, Any] | None = None,
                      *, direct: bool = False) -> Result:
        t0 = time.monotonic()
        params = params or {}
        options = params.get("options") or {}
        resolved = self.catalog.resolve(spec, options if isinstance(options, dict) else None)
        plan = plan_extract(resolved, params)
        self._check_items(resolved, items)
        lm = await self._ready_model(resolved)
        timing = Timing()
        units, raws = await self._infer(lm, plan.ctx, items, direct, timing)
        out = [extract_item(raw, item, i) for i, (raw, item) in enumerate(zip(raws, items, strict=True))]
        timing.total_ms = (time.monotonic() - t0) * 1000
        return Result(out, timing, sum(u.input_tokens for u in units))

    # ---- the sidecar path ------------------------------------------------------------------
    async def run_work_items(self, items: list[WorkItem]) -> list[WorkResult]:
        """Execute NATS work items at once; one WorkResult per item, in order."""
        groups: dict[str, list[int]] = {}
        for i, wi in enumerate(items):
            groups.setdefault(_group_key(wi), []).append(i)
        results: list[WorkResult | None] = [None] * len(items)
        await asyncio.gather(*(self._run_group([items[i] for i in idx], idx, results) for idx in groups.values()))
        return [r for r in results if r is not None]

    async def _run_group(self, group: list[WorkItem], idx: list[int], results: list[WorkResult | None]) -> None:
        first = group[0]
        spec = first.model_id if first.profile_id in (None, "", "default") else f"{first.model_id}:{first.profile_id}"
        options = dict(first.options or {})
        if first.is_query:
            options["is_query"] = True
        started = time.time()
        try:
            if first.operation == "encode":
                params = {"output_types": first.output_types, "output_dtype": first.output_dtype,
                          "instruction": first.instruction, "options": options}
                res = await self.encode(spec, [wi.item or {} for wi in group], params, direct=True)
                payloads = [packb(item) for item in res.items]
                tokens = [None] * len(group)
            elif first.operation == "score":
                # one work item carries a whole score request; run each on its own
                for wi, i in zip(group, idx, strict=True):
                    res = await self.score(spec, wi.query_item or {}, wi.score_items or [], wi.instruction,
                                           options, direct=True)
                    body = {"scores": res.items}
                    if res.query_id is not None:
                        body["query_id"] = res.query_id
                    results[i] = self._work_result(wi, True, packb(body), res.timing, started, res.input_tokens)
                return
            elif first.operation == "extract":
                params = {"labels": first.labels, "output_schema": first.output_schema,
                          "instruction": first.instruction, "options": options}
                res = await self.extract(spec, [wi.item or {} for wi in group], params, direct=True)
                payloads = [packb(item) for item in res.items]
                tokens = [None] * len(group)
            else:
                raise invalid_input(f"unknown operation {first.operation!r}")
        except SIEError as exc:
            for wi, i in zip(group, idx, strict=True):
                results[i] = self._error_result(wi, exc)
            return
        except Exception as exc:
            log.exception("work items for %s failed", spec)
            err = SIEError(ErrorCode.INFERENCE_ERROR, f"internal error: {exc}")
            for wi, i in zip(group, idx, strict=True):
                results[i] = self._error_result(wi, err)
            return
        for wi, i, payload, tok in zip(group, idx, payloads, tokens, strict=True):
            results[i] = self._work_result(wi, True, payload, res.timing, started, tok)

    def _work_result(self, wi: WorkItem, ok: bool, payload: bytes, timing: Timing, started: float,
                     tokens: int | None) -> WorkResult:
        return WorkResult(
            work_item_id=wi.work_item_id,
            request_id=wi.request_id,
            item_index=wi.item_index,
            success=ok,
            result_msgpack=payload,
            inference_ms=timing.inference_ms,
            queue_ms=max(0.0, (started - wi.timestamp) * 1000) + timing.queue_ms,
            tokenization_ms=timing.tokenization_ms,
            postprocessing_ms=timing.postprocessing_ms,
            processing_ms=timing.total_ms,
            input_tokens=tokens,
        )

    @staticmethod
    def _error_result(wi: WorkItem, exc: SIEError) -> WorkResult:
        return WorkResult(
            work_item_id=wi.work_item_id,
            request_id=wi.request_id,
            item_index=wi.item_index,
            success=False,
            error=exc.message,
            error_code=exc.code,
            retry_after_s=exc.retry_after,
            error_extra=dict(exc.extra) or None,
        )

    # ---- control-plane config ---------------------------------------------------------------
    def bundle_config_hash(self, *, pool: str | None = "", adapters: list[str] | None = None) -> str:
        """This worker's hash of its bundle (internals 4.8), scoped to ``pool``.

        ``pool=""`` (the default) means this worker's own pool (``SIE_POOL``); ``None`` = unscoped,
        every model of the bundle. The config service publishes both: ``bundle_config_hash``
        (unscoped) and ``bundle_pool_config_hashes[bundle][pool]``; the sidecar compares the scoped
        one when the control plane sends it. The bundle's adapter list is the control plane's when it
        sent one (so both sides hash the same profiles), else the image's bundle file.
        """
        bundle = self._bundle(adapters)
        if bundle is None:
            return ""
        scope = self.settings.pool if pool == "" else pool
        return bundle_config_hash(bundle, self.catalog.models(), pool=scope)

    def _bundle(self, adapters: list[str] | None = None) -> Bundle | None:
        adapters = adapters if adapters is not None else self._control_adapters
        if adapters is not None:
            return Bundle(name=self.settings.bundle, adapters=list(adapters))
        return self.catalog.get_bundle(self.settings.bundle)

    def _module_importable(self, module: str) -> bool:
        ok = self._importable.get(module)
        if ok is None:
            try:
                ok = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                ok = False
            self._importable[module] = ok
        return ok

    def is_supported(self, config: ModelConfig) -> bool:
        """False when a profile this bundle would serve names an adapter module this image lacks."""
        bundle = self._bundle()
        modules = set(bundle.adapters) if bundle is not None else None
        for name in config.profiles:
            module = config.resolved_profile(name).adapter_module
            if module and (modules is None or module in modules) and not self._module_importable(module):
                return False
        return True

    def _note_support(self, config: ModelConfig) -> None:
        if self.is_supported(config):
            self.unsupported_models.discard(config.sie_id)
        else:
            log.warning("model %s names an adapter this worker image lacks: unsupported", config.sie_id)
            self.unsupported_models.add(config.sie_id)

    async def apply_model_config(self, config: ModelConfig, *, bundle_adapters: list[str] | None = None) -> None:
        """Add or update one model (the full merged config of a delta); other models stay as they are.

        Loaded entries of the model whose load-time state changed are unloaded, so the next request
        loads the new profile instead of silently running the old one.
        """
        if bundle_adapters is not None:
            self._control_adapters = list(bundle_adapters)
        old = self.catalog.get(config.sie_id)
        self.catalog.put(config)
        self._note_support(config)
        if old is not None and old != config:
            await self._drop_stale_entries(config.sie_id)

    async def replace_model_configs(
        self, configs: list[ModelConfig], *, bundle_adapters: list[str] | None = None
    ) -> None:
        """The control plane's full model set (an export): image models not named keep their baseline."""
        if bundle_adapters is not None:
            self._control_adapters = list(bundle_adapters)
        before = {m.sie_id: m for m in self.catalog.models()}
        wanted = dict(self._baseline)
        wanted.update({c.sie_id: c for c in configs})
        self.catalog.replace(list(wanted.values()))  # bundles are kept
        self.unsupported_models = set()
        for config in wanted.values():
            self._note_support(config)
        for model_id, old in before.items():
            if wanted.get(model_id) != old:
                await self._drop_stale_entries(model_id)

    async def _drop_stale_entries(self, model_id: str) -> None:
        """Unload (or forget) the model's entries whose load-time state differs from the catalog's."""
        config = self.catalog.get(model_id)
        current: dict[tuple, ModelConfig] = {}
        if config is not None:
            for name in config.profiles:
                try:
                    current[load_signature(Resolved(config, name, config.resolved_profile(name)))] = config
                except Exception:  # noqa: BLE001 - an unresolvable profile has no valid entry
                    continue
        model_fields = config.model_dump(exclude={"profiles"}) if config is not None else None
        for key, entry in list(self._entries.items()):
            if entry.model_id != model_id:
                continue
            loaded_fields = (
                entry.loaded.resolved.config.model_dump(exclude={"profiles"}) if entry.loaded else model_fields
            )
            if key in current and loaded_fields == model_fields and entry.state != "failed":
                continue
            log.info("config of %s changed: dropping its %s entry %s", model_id, entry.state, key[1:])
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()
            if entry.loaded is not None:
                await self._unload(entry)
            self._entries.pop(key, None)


def _group_key(wi: WorkItem) -> str:
    return json.dumps(
        [wi.operation, wi.model_id, wi.profile_id, wi.output_types, wi.output_dtype, wi.instruction,
         wi.is_query, wi.options, wi.labels, wi.output_schema],
        sort_keys=True, default=str,
    )


def rank_scores(scores: list[float], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    values = [float(s) for s in scores]
    if not all(math.isfinite(v) for v in values):
        raise SIEError(ErrorCode.INFERENCE_ERROR, "the model produced non-finite scores")
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return [
        {"item_id": items[i].get("id") or f"item-{i}", "score": values[i], "rank": rank}
        for rank, i in enumerate(order)
    ]


def extract_item(raw: dict[str, Any], item: dict[str, Any], index: int) -> dict[str, Any]:
    out = {
        "id": item.get("id") or f"item-{index}",
        "entities": list(raw.get("entities") or []),
        "relations": list(raw.get("relations") or []),
        "classifications": list(raw.get("classifications") or []),
        "objects": list(raw.get("objects") or []),
        "data": dict(raw.get("data") or {}),
    }
    if raw.get("error"):
        out["error"] = raw["error"]
    return out


__all__ = ["EnsureResult", "LoadedModel", "Result", "Runtime", "Timing"]
