"""Running inputs on a loaded model: LoRA check, tokenisation, the batcher or a direct run on a
forward thread, postprocessing. The executor knows nothing of which models are loaded: it is handed
one, and a thread pool for the CPU work around its forwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor as ThreadPool
from typing import Any, TypeVar

from protocol import tracing
from protocol.batching import chunk_by_cost
from protocol.errors import invalid_input
from protocol.params import lora_refusal
from protocol.priority import INTERACTIVE
from worker.adapters.base import Prepared, RequestContext
from worker.batching.former import BatchInfo, token_counts
from worker.models.loaded import LoadedModel
from worker.runtime.results import Timing

T = TypeVar("T")

# what runs on a batch's outputs before they leave the worker: (units, outputs) -> outputs
Post = Callable[[list[Prepared], list[Any]], list[Any]]


class Executor:
    def __init__(self, cpu_pool: ThreadPool, *, max_padding_share: float) -> None:
        """``cpu_pool``: tokenising and postprocessing; ``max_padding_share``: where a direct batch is
        cut into forwards (as the BatchFormer cuts)."""
        self.cpu_pool = cpu_pool
        self.max_padding_share = max_padding_share

    async def _ensure_lora(self, lm: LoadedModel, lora: str | None) -> None:
        """A request naming a LoRA needs a model that supports them and declares it, and the LoRA loaded
        (else 503)."""
        if not lora:
            return
        if not lm.adapter.supports_lora:
            raise invalid_input(f"Model '{lm.model_id}' does not support LoRA adapters", param="lora")
        # again here (the front doors checked it): only an adapter the loaded config declares is loaded
        refusal = lora_refusal(lm.resolved.config, lora)
        if refusal is not None:
            raise refusal
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

    async def infer(
        self,
        lm: LoadedModel,
        ctx: RequestContext,
        inputs: list[Any],
        direct: bool,
        timing: Timing,
        *,
        priority: str = INTERACTIVE,
        post: Post | None = None,
    ) -> tuple[list[Prepared], list[Any]]:
        """Tokenise ``inputs`` and run them (the model's batcher in ``priority``'s class, or at once
        when ``direct``); then ``post(units, outputs)``, when given, whose result is the outputs.

        Direct, where no batch waits behind a running forward (on CPU, one batch per forward thread), the
        whole batch is one call on a forward thread: tokenising, its forwards and ``post``. Hops to
        the CPU pool around the forward would overlap nothing there, and each costs the worker CPU
        (two threads handing the GIL over): 0.61-0.64 against 0.43-0.44 ms per batch of ten
        zero-cost items, measured in-process. Otherwise tokenising and ``post`` run on the CPU pool,
        so the next batch tokenises while a forward runs (CUDA: one queued behind the running one),
        and requests tokenise as they arrive (the batched path).

        On the batched path the request is announced to the model's BatchFormer before it
        tokenises, so a batch about to run waits for it briefly instead of running without it.
        """
        await self._ensure_lora(lm, ctx.lora)
        if direct and lm.forwards_in_flight <= lm.forward_threads:
            self._check_operation(lm, ctx)
            with lm.loras.use(ctx.lora):
                units, outputs, forwards = await lm.on_forward_thread(
                    self._run_on_thread, lm, ctx, inputs, timing, time.monotonic(), post, priority=priority
                )
            for batch in forwards:
                lm.count(ctx, batch)
            return units, outputs
        if not direct:
            lm.former.expect()
        t = time.monotonic()
        try:
            with tracing.span("worker.tokenize", attributes={"items": len(inputs)}):
                units = await self._prepare(lm, ctx, inputs)
        except BaseException:
            if not direct:
                lm.former.unexpect()
            raise
        timing.tokenization_ms = (time.monotonic() - t) * 1000
        with lm.loras.use(ctx.lora):
            outputs = await self._execute(lm, ctx, units, direct, timing, priority=priority)
        if post is not None:
            t = time.monotonic()
            with tracing.span("worker.postprocess"):
                outputs = await self.offload(post, units, outputs)
            timing.postprocessing_ms = (time.monotonic() - t) * 1000
        return units, outputs

    def _check_operation(self, lm: LoadedModel, ctx: RequestContext) -> None:
        if ctx.op not in lm.adapter.operations:
            raise invalid_input(f"Model '{lm.model_id}' does not support {ctx.op}")

    def _run_on_thread(
        self,
        lm: LoadedModel,
        ctx: RequestContext,
        inputs: list[Any],
        timing: Timing,
        submitted: float,
        post: Post | None,
    ) -> tuple[list[Prepared], list[Any], list[list[Prepared]]]:
        """A direct batch on its forward thread: tokenise, forward, ``post``; returns the units,
        the outputs and each forward's units (for :meth:`LoadedModel.count`, on the loop)."""
        t = time.monotonic()
        timing.queue_ms = (t - submitted) * 1000  # waiting for the forward thread
        with tracing.span("worker.tokenize", attributes={"items": len(inputs)}):
            units = lm.adapter.prepare(ctx, inputs)
        timing.tokenization_ms = (time.monotonic() - t) * 1000
        outputs, forwards = self._forward_chunks(lm, ctx, units, timing, time.monotonic())
        if post is not None:
            t = time.monotonic()
            with tracing.span("worker.postprocess"):
                outputs = post(units, outputs)
            timing.postprocessing_ms = (time.monotonic() - t) * 1000
        return units, outputs, forwards

    def _forward_chunks(
        self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared], timing: Timing, submitted: float
    ) -> tuple[list[Any], list[list[Prepared]]]:
        """On a forward thread: ``units`` in forwards of at most the model's batch cost; the outputs
        in order, and each forward's units."""
        outputs: list[Any] = [None] * len(units)
        forwards: list[list[Prepared]] = []
        packed = lm.adapter.runs_packed(ctx)
        for chunk in chunk_by_cost(
            units, lm.max_cost, lm.max_requests, self.max_padding_share, packed=packed
        ):
            batch = [units[i] for i in chunk]
            started = time.monotonic()
            with tracing.span("worker.forward") as span:
                if span is not None:
                    real, padded = token_counts(batch, packed)
                    tracing.set_attributes(
                        span,
                        model=lm.model_id,
                        batch_size=len(chunk),
                        tokens=real,
                        padding_share=padded / max(1, padded + real),
                    )
                outs = lm.forward(ctx, batch)
            timing.queue_ms = max(timing.queue_ms, (started - submitted) * 1000)
            timing.inference_ms += (time.monotonic() - started) * 1000
            forwards.append(batch)
            for i, out in zip(chunk, outs, strict=True):
                outputs[i] = out
        return outputs, forwards

    async def _execute(
        self,
        lm: LoadedModel,
        ctx: RequestContext,
        units: list[Prepared],
        direct: bool,
        timing: Timing,
        *,
        priority: str = INTERACTIVE,
    ) -> list[Any]:
        try:
            self._check_operation(lm, ctx)
        except BaseException:
            if not direct:
                lm.former.unexpect()
            raise
        submitted = time.monotonic()
        if direct:  # tokenised on the CPU pool already: the forwards, in one call on a forward thread
            outputs, forwards = await lm.on_forward_thread(
                self._forward_chunks, lm, ctx, units, timing, submitted, priority=priority
            )
            for batch in forwards:
                lm.count(ctx, batch)
            return outputs
        futures = lm.former.submit(ctx, units, expected=True, priority=priority)
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

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the CPU pool (tokenizer calls, postprocessing)."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)
