"""The model runtime: a plain Python API over loaded models, used by both front doors.

``encode``/``score``/``extract``/``tokenize`` take typed request pieces (the items and params of
:mod:`protocol.api`) and return response pieces; with ``direct=False`` (standalone HTTP) items go through the model's BatchFormer and share
forward passes with concurrent requests; with ``direct=True`` (sidecar path, which has already
batched) they run at once. ``run_work_items`` executes a batch of NATS work items for the IPC front
door.

The runtime wires parts that each do one job and see each other only through narrow Protocols:

- models (:mod:`worker.models`): the :class:`~worker.models.table.ModelTable` of entries, the
  :class:`~worker.models.memory.MemoryManager` that evicts from it, the
  :class:`~worker.models.recovery.OomRecovery` every forward pass goes through (it reaches memory
  through ``Siblings``), and the :class:`~worker.models.registry.ModelRegistry` that loads models;
- the request path (:mod:`worker.runtime`): the :class:`~worker.runtime.executor.Executor`
  (tokenise, batch or run at once, postprocess), the :class:`~worker.runtime.chunking.Chunker`
  (``overflow_policy: chunk``; sees the executor as ``Inference``), the
  :class:`~worker.runtime.operations.Operations` (sees the registry as ``ModelSource``), the
  :class:`~worker.runtime.work_items.WorkItemRunner` (the sidecar path; sees them as ``SupportsOperations``);
- the :class:`~worker.runtime.control_config.ControlConfig` (config deltas; sees the registry as
  ``StaleModels``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from protocol.api import EncodeParams, ExtractParams, Item, ScoreParams, TokenizeParams
from protocol.catalog import Catalog
from protocol.jobs import JobItem
from protocol.model_config import ModelConfig
from protocol.priority import INTERACTIVE
from protocol.work import WorkResult
from worker.batching.former import BatchStats
from worker.metrics import WorkerMetrics
from worker.models.loaded import LoadedModel
from worker.models.loop_bridge import LoopBridge
from worker.models.memory import MemoryManager, MemoryUsage, SiblingEviction
from worker.models.placement import place_process
from worker.models.recovery import OomRecovery
from worker.models.registry import EnsureResult, ModelRegistry
from worker.models.table import ModelTable
from worker.models.weights import WeightCache, WeightsReport
from worker.models.weights_watch import WeightsWatch
from worker.runtime.chunking import Chunker
from worker.runtime.control_config import ControlConfig
from worker.runtime.executor import Executor
from worker.runtime.operations import Operations
from worker.runtime.results import Result
from worker.runtime.work_items import WorkItemRunner
from worker.settings import WorkerSettings


class Runtime:
    """Models, batching and execution for both front doors (``sie serve`` and the IPC server)."""

    def __init__(self, settings: WorkerSettings | None = None, catalog: Catalog | None = None) -> None:
        self.settings = s = settings or WorkerSettings()
        self.catalog = catalog if catalog is not None else Catalog.from_dirs(s.models_dir, s.bundles_dir)
        self.placement = place_process(s)
        self.metrics = WorkerMetrics()
        self.weights = WeightCache.from_settings(s)
        self.cpu_pool = ThreadPoolExecutor(max_workers=s.cpu_workers, thread_name_prefix="cpu")
        loop = LoopBridge()
        table = ModelTable(
            retry_after_s=s.model_loading_retry_after_s, clear_cache=self.placement.clear_cache
        )
        self.memory = MemoryManager(
            MemoryUsage(self.placement.device, s.memory_budget_bytes, table.loaded),
            table.evictable,
            table.evict,
            threshold_percent=s.memory_pressure_threshold_percent,
        )
        self.recovery = OomRecovery(
            s,
            self.metrics,
            siblings=SiblingEviction(self.memory, loop),
            clear_cache=self.placement.clear_cache,
        )
        self.models = ModelRegistry(
            s,
            self.catalog,
            placement=self.placement,
            table=table,
            memory=self.memory,
            weights=self.weights,
            loop=loop,
            metrics=self.metrics,
            forward=self.recovery.forward,
        )
        self.executor = Executor(self.cpu_pool, max_padding_share=s.max_padding_share)
        self.operations = Operations(
            s,
            self.catalog,
            models=self.models,
            executor=self.executor,
            chunker=Chunker(self.executor, max_chunks_per_item=s.max_chunks_per_item),
            metrics=self.metrics,
        )
        self.work_items = WorkItemRunner(self.operations)
        self.weights_watch = WeightsWatch(
            WeightsReport(self.weights), self.catalog.models, interval_s=s.weights_check_interval_s
        )
        self.control = ControlConfig(
            self.catalog,
            bundle=s.bundle,
            pool=s.pool,
            stale=self.models,
            on_change=self.weights_watch.recheck,
        )
        self.metrics.watch(self)
        self.started_at = time.time()
        self.ready = False

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.models.start()
        self.weights_watch.start()
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        self.weights_watch.stop()
        await self.models.close()
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)

    # ---- state -----------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self.placement.device

    @property
    def recovery_events(self) -> list[tuple[str, str]]:
        """(model, OOM recovery step) of the latest recovery steps, oldest first."""
        return list(self.recovery.events)

    @property
    def unsupported_models(self) -> set[str]:
        return self.control.unsupported_models

    def loaded(self) -> list[LoadedModel]:
        return self.models.loaded()

    def set_pool_pins(self, specs: list[str]) -> None:
        """The pinned models of the pools this worker serves (sent by the sidecar in each Ping)."""
        self.models.set_pins(self.models.static_pins, specs)

    def pinned_models(self) -> list[str]:
        return self.models.pinned_models()

    def loaded_models(self) -> list[str]:
        return self.models.loaded_models()

    def loading_models(self) -> list[str]:
        return self.models.loading_models()

    def profile_states(self) -> dict[str, tuple[str, str | None]]:
        return self.models.profile_states()

    def model_state(self, model_id: str, profile: str | None = None) -> tuple[str, dict[str, Any] | None]:
        return self.models.model_state(model_id, profile)

    def loaded_precision(self, model_id: str, profile: str) -> str | None:
        return self.models.loaded_precision(model_id, profile)

    def weights_status(self) -> dict[str, str]:
        """Model id → where its weights are (``GET /v1/models``'s ``weights``)."""
        return self.weights_watch.status()

    def batch_stats(self) -> BatchStats:
        return self.models.batch_stats()

    def queue_depth(self) -> int:
        return self.models.queue_depth()

    def memory_usage(self) -> tuple[int, int]:
        return self.memory.usage()

    def evictions(self) -> int:
        return len(self.memory.evicted)

    async def ensure_ready(self, spec: str) -> EnsureResult:
        return await self.models.ensure_ready(spec)

    # ---- requests --------------------------------------------------------------------------
    # ``priority``: the request's class (interactive | bulk) in the model's BatchFormer; the direct
    # path (queue mode, the sidecar batched already) ignores it
    async def encode(
        self,
        spec: str,
        items: Sequence[Item],
        params: EncodeParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        return await self.operations.encode(spec, items, params, direct=direct, priority=priority)

    async def score(
        self,
        spec: str,
        query: Item,
        items: Sequence[Item],
        params: ScoreParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        return await self.operations.score(spec, query, items, params, direct=direct, priority=priority)

    async def extract(
        self,
        spec: str,
        items: Sequence[Item],
        params: ExtractParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result:
        return await self.operations.extract(spec, items, params, direct=direct, priority=priority)

    async def tokenize(
        self, spec: str, items: Sequence[Item], params: TokenizeParams | None = None, *, direct: bool = False
    ) -> Result:
        return await self.operations.tokenize(spec, items, params, direct=direct)

    async def run_work_items(self, items: list[JobItem], *, priority: str = INTERACTIVE) -> list[WorkResult]:
        return await self.work_items.run_work_items(items, priority=priority)

    # ---- control-plane config --------------------------------------------------------------
    def bundle_config_hash(self, *, pool: str | None = "", adapters: list[str] | None = None) -> str:
        return self.control.bundle_config_hash(pool=pool, adapters=adapters)

    def is_supported(self, config: ModelConfig) -> bool:
        return self.control.is_supported(config)

    async def apply_model_config(
        self, config: ModelConfig, *, bundle_adapters: list[str] | None = None
    ) -> None:
        await self.control.apply_model_config(config, bundle_adapters=bundle_adapters)

    async def remove_model_config(self, model_id: str, *, bundle_adapters: list[str] | None = None) -> None:
        await self.control.remove_model_config(model_id, bundle_adapters=bundle_adapters)

    async def replace_model_configs(
        self, configs: list[ModelConfig], *, bundle_adapters: list[str] | None = None
    ) -> None:
        await self.control.replace_model_configs(configs, bundle_adapters=bundle_adapters)


__all__ = ["EnsureResult", "LoadedModel", "Result", "Runtime"]
