"""A loaded model (adapter, inference lanes, batcher, LoRAs) and the entry tracking its state."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import itertools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.catalog import Resolved
from protocol.errors import SIEError
from worker.adapters.base import Adapter, Prepared, RequestContext
from worker.batching.former import BatchFormer, BatchStats
from worker.batching.lanes import ForwardGate
from worker.models.lora import LoraSet

if TYPE_CHECKING:
    from worker.models.registry import ModelStates


T = TypeVar("T")

ON_LOOP_TIMEOUT_S = 300.0  # a worker thread waiting on the loop (evictions) never hangs past this
_use_clock = itertools.count(1)  # orders models by last use (the memory manager's LRU)


def pick_device(setting: str) -> str:
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tune_process_for_cuda() -> None:
    """Process-wide CUDA choices for serving: no attention backend that compiles per shape.

    PyTorch's SDPA picks cuDNN attention for half precision, and cuDNN builds a plan for every new
    (batch, width) shape: tens to hundreds of milliseconds on the hot path of mixed traffic.
    """
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


class LoadedModel:
    """A loaded adapter with its own inference lanes and batcher."""

    def __init__(self, runtime: ModelStates, key: tuple, resolved: Resolved, adapter: Adapter) -> None:
        self.key = key
        self.model_id = resolved.model_id
        self.resolved = resolved
        self.adapter = adapter
        # the inference lanes (worker/batching/lanes.py): forwards run on these threads, together through
        # the gate unless one changes state the others see
        self.lanes = runtime.forward_lanes
        self.executor = ThreadPoolExecutor(
            max_workers=self.lanes, thread_name_prefix=f"infer-{resolved.model_id}"
        )
        self.gate = ForwardGate()
        s = runtime.settings
        self.max_cost = min(s.max_batch_cost, resolved.profile.max_batch_tokens or s.max_batch_cost)
        self.max_requests = s.max_batch_requests
        self.stats = BatchStats()
        self.last_used = next(_use_clock)
        self.closed = False
        self._runtime = runtime
        self._forward_seconds = runtime.metrics.forward_seconds.labels(self.model_id)
        self.loras = LoraSet(
            resolved.model_id,
            adapter,
            max_loras=s.max_loras_per_model,
            resolve=runtime.resolve_lora,
            resolve_pool=runtime._lora_pool,
            on_inference_thread=self.alone,
            retry_after_s=s.lora_loading_retry_after_s,
            failure_cooldown_s=s.load_failure_cooldown_s,
        )
        # batches handed to the lanes at once: on CUDA the next one queued while a forward runs,
        # on CPU one per lane
        self.forwards_in_flight = s.forwards_in_flight or (2 if runtime.on_cuda else self.lanes)
        self.former = BatchFormer(
            self.run,
            max_cost=self.max_cost,
            max_requests=self.max_requests,
            max_wait_ms=s.max_batch_wait_ms,
            coalesce_ms=s.batch_coalesce_ms,
            max_pad_share=s.max_padding_share,
            packs=adapter.runs_packed,
            in_flight=self.forwards_in_flight,
            lanes=self.lanes,
            bulk_mixed_requests=s.serve_bulk_mixed_batch_requests,
            bulk_mixed_window_s=s.serve_bulk_mixed_window_s,
            bulk_max_wait_ms=s.serve_bulk_max_wait_ms,
            name=resolved.model_id,
        )

    async def run(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """One forward pass (with OOM recovery) on one of this model's inference lanes."""
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self.executor, self.forward, ctx, units)
        self.count(ctx, units)
        return outputs

    async def on_lane(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of this model's inference lanes, in the caller's context (its trace
        span and log fields), for work that runs its forwards itself (:meth:`forward`)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    def count(self, ctx: RequestContext, units: list[Prepared]) -> None:
        """Count one forward pass of ``units`` in the model's batch statistics and metrics (on the loop)."""
        real = padded = 0
        if self.adapter.token_costed:
            real, padded = self.stats.record(units, packed=self.adapter.runs_packed(ctx))
        self._runtime.metrics.observe_batch(self.model_id, len(units), real, padded)

    def forward(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """One forward pass, with OOM recovery, on the calling inference lane."""
        with self.gate.shared():
            if not self.adapter.forwards_share_state():
                return self._timed_forward(ctx, units)
        with self.gate.exclusive():  # a LoRA is loaded: activating one changes every lane's model
            return self._timed_forward(ctx, units)

    def _timed_forward(self, ctx: RequestContext, units: list[Prepared]) -> list[Any]:
        """The forward pass, its time added to ``sie_worker_forward_seconds_total`` (from the lane:
        the counter takes its own lock)."""
        started = time.monotonic()
        try:
            return self._runtime.forward_with_recovery(self, ctx, units)
        finally:
            self._forward_seconds.inc(time.monotonic() - started)

    async def alone(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on an inference lane while no forward runs (LoRA loads and unloads, unload)."""

        def call() -> T:
            with self.gate.exclusive():
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    def touch(self) -> None:
        self.last_used = next(_use_clock)

    def memory_bytes(self) -> int:
        return self.adapter.memory_bytes()


@dataclass
class ModelEntry:
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
