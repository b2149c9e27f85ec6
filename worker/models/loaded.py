"""A loaded model (adapter, forward threads, batcher, LoRAs) and the entry tracking its state."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import itertools
import json
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from protocol.catalog import Resolved
from protocol.errors import SIEError
from protocol.model_config import ModelConfig
from protocol.priority import BULK, INTERACTIVE
from worker.adapters.base import Adapter, Prepared, RequestContext
from worker.batching.former import BatchFormer, BatchStats
from worker.batching.forward_threads import ForwardGate
from worker.batching.preemption import Preemption
from worker.metrics import WorkerMetrics
from worker.models.lora import LoraSet
from worker.models.placement import Placement
from worker.settings import WorkerSettings

T = TypeVar("T")

_use_clock = itertools.count(1)  # orders models by last use (the memory manager's LRU)

#: a loaded model's identity, its load signature: (model id, adapter path, precision, load-time
#: options as canonical JSON); profiles that share it share one loaded model
ModelKey = tuple[str, str | None, str, str]

#: one forward pass of a loaded model on the calling forward thread, OOM recovery included
#: (:class:`worker.models.recovery.OomRecovery`)
ForwardFn = Callable[["LoadedModel", RequestContext, list[Prepared]], list[Any]]


@dataclass(frozen=True)
class ModelEnv:
    """What every loaded model is built with: the worker's settings and placement, its metrics, the
    forward pass with recovery, and where LoRAs come from."""

    settings: WorkerSettings
    placement: Placement
    metrics: WorkerMetrics
    forward: ForwardFn
    # (a model's config, a LoRA it declares) -> the LoRA's directory
    resolve_lora: Callable[[ModelConfig, str], Path]
    lora_pool: Executor


class LoadedModel:
    """A loaded adapter with its own forward threads and batcher."""

    def __init__(self, key: ModelKey, resolved: Resolved, adapter: Adapter, env: ModelEnv) -> None:
        self.key = key
        self.model_id = resolved.model_id
        self.resolved = resolved
        self.adapter = adapter
        s = env.settings
        # the forward threads (worker/batching/forward_threads.py): forwards run on these threads, together
        # through the gate unless one changes state the others see
        self.forward_threads = env.placement.forward_threads
        self.executor = ThreadPoolExecutor(
            max_workers=self.forward_threads, thread_name_prefix=f"infer-{resolved.model_id}"
        )
        self.gate = ForwardGate()
        # CPU, one forward thread: an interactive batch runs inside a running bulk forward, between
        # two blocks of its layers (worker/batching/preemption.py)
        preempts = not env.placement.on_cuda and self.forward_threads == 1 and s.preempt_max_share > 0
        self.preemption = Preemption(
            allowed=lambda: not adapter.forwards_share_state(),
            max_share=s.preempt_max_share,
            on_preempt=env.metrics.preemptions.labels(resolved.model_id).inc,
            quiet_s=s.preempt_quiet_ms / 1000.0,
            threads=env.placement.intra_op_threads if preempts else 1,
            set_threads=_set_torch_threads if preempts else lambda n: None,
            spare_core_s=s.preempt_spare_core_ms / 1000.0,
        )
        if preempts:
            self.preemption.install(getattr(adapter, "model", None))
        limits = s.batch_limits(resolved.profile.max_batch_tokens)
        self.max_cost = limits.max_cost
        self.max_requests = limits.max_requests
        self.stats = BatchStats()
        self.last_used = next(_use_clock)
        self.last_used_at = time.monotonic()  # for the idle unload (SIE_MODEL_IDLE_TIMEOUT_S)
        self.used = False  # a request has reached it since it loaded
        self.closed = False
        self._forward_fn = env.forward
        self._metrics = env.metrics
        self._forward_seconds = env.metrics.forward_seconds.labels(self.model_id)
        self.loras = LoraSet(
            resolved.model_id,
            adapter,
            max_loras=s.max_loras_per_model,
            resolve=functools.partial(env.resolve_lora, resolved.config),
            resolve_pool=env.lora_pool,
            on_inference_thread=self.alone,
            retry_after_s=s.lora_loading_retry_after_s,
            failure_cooldown_s=s.load_failure_cooldown_s,
        )
        # batches handed to the forward threads at once: on CUDA the next one queued while a
        # forward runs, on CPU one per forward thread
        self.forwards_in_flight = s.forwards_in_flight or (
            2 if env.placement.on_cuda else self.forward_threads
        )
        self.former = BatchFormer(
            self.run,
            limits=limits,
            packs=adapter.runs_packed,
            in_flight=self.forwards_in_flight,
            forward_threads=self.forward_threads,
            name=resolved.model_id,
        )

    async def run(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """One forward pass (with OOM recovery) on one of this model's forward threads."""
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self.executor, self.forward, ctx, units)
        self.count(ctx, units)
        return outputs

    async def on_forward_thread(self, fn: Callable[..., T], *args: Any, priority: str = INTERACTIVE) -> T:
        """``fn(*args)`` on one of this model's forward threads, in the caller's context (its trace
        span and log fields), for work that runs its forwards itself (:meth:`forward`). Interactive
        work that finds a bulk call there runs inside its forward, at the next layer
        (:class:`Preemption`), or right after it."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        loop = asyncio.get_running_loop()
        if priority == BULK:
            return await asyncio.wrap_future(self.preemption.bulk(self.executor, call))
        if self.preemption.bulk_running and self.preemption.hooked_layers:
            return await asyncio.wrap_future(self.preemption.submit(self.executor, call))
        return await loop.run_in_executor(self.executor, self._interactive, call)

    def _interactive(self, call: Callable[[], T]) -> T:
        """An interactive call on the forward thread, outside a bulk forward: the next bulk forward
        keeps quiet after it (:class:`Preemption`)."""
        try:
            return call()
        finally:
            self.preemption.interactive_ended()

    def count(self, ctx: RequestContext, units: list[Prepared]) -> None:
        """Count one forward pass of ``units`` in the model's batch statistics and metrics (on the loop)."""
        real = padded = 0
        if self.adapter.token_costed:
            real, padded = self.stats.record(units, packed=self.adapter.runs_packed(ctx))
        self._metrics.observe_batch(self.model_id, len(units), real, padded)

    def forward(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """One forward pass, with OOM recovery, on the calling forward thread."""
        with self.gate.shared():
            if not self.adapter.forwards_share_state():
                return self._timed_forward(ctx, units)
        with self.gate.exclusive():  # a LoRA is loaded: activating one changes every forward thread's model
            return self._timed_forward(ctx, units)

    def _timed_forward(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """The forward pass, its time added to ``sie_worker_forward_seconds_total`` (from the forward thread:
        the counter takes its own lock)."""
        started = time.monotonic()
        try:
            return self._forward_fn(self, ctx, units)
        finally:
            self._forward_seconds.inc(time.monotonic() - started)

    async def alone(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on a forward thread while no forward runs (LoRA loads and unloads, unload)."""

        def call() -> T:
            with self.gate.exclusive():
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    async def close(self, reason: SIEError) -> None:
        """Unload: queued requests fail with ``reason``, the adapter lets its weights go (on a forward
        thread, while no forward runs), the forward threads stop."""
        self.closed = True
        self.loras.close()
        await self.former.close(reason)
        await self.alone(self.adapter.unload)
        self.executor.shutdown(wait=False)

    def touch(self) -> None:
        self.last_used = next(_use_clock)
        self.last_used_at = time.monotonic()
        self.used = True

    def memory_bytes(self) -> int:
        return self.adapter.memory_bytes()


@dataclass
class ModelEntry:
    key: ModelKey
    model_id: str
    state: str = "absent"  # absent | loading | loaded | failed
    loaded: LoadedModel | None = None
    task: asyncio.Task[None] | None = None
    error: SIEError | None = None
    attempts: int = 0
    failed_at: float = 0.0


def _set_torch_threads(n: int) -> None:
    """torch's intra-op threads from now on. torch keeps one count for the whole process, so the
    count is read each time rather than remembered: another model's bulk forward may have set it."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def load_signature(resolved: Resolved) -> ModelKey:
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
