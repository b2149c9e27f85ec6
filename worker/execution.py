"""Running prepared inputs: LoRA check, tokenisation on the CPU pool, the batcher or a direct run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from protocol import tracing
from protocol.catalog import Resolved
from protocol.errors import invalid_input
from protocol.priority import INTERACTIVE
from worker.adapters.base import Prepared, RequestContext
from worker.batching import BatchInfo, chunk_by_cost, token_counts
from worker.loaded import LoadedModel
from worker.recovery import OomRecovery
from worker.results import Timing


class Execution(OomRecovery):
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
                     timing: Timing, *, priority: str = INTERACTIVE) -> tuple[list[Prepared], list[Any]]:
        """Tokenise ``inputs`` (CPU pool) and run them (batcher in ``priority``'s class, or at once
        when ``direct``).

        On the batched path the request is announced to the model's BatchFormer before it
        tokenises, so a batch about to run waits for it briefly instead of running without it.
        """
        await self._ensure_lora(lm, ctx.lora)
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
        return units, outputs

    async def _execute(self, lm: LoadedModel, ctx: RequestContext, units: list[Prepared], direct: bool,
                       timing: Timing, *, priority: str = INTERACTIVE) -> list[Any]:
        if ctx.op not in lm.adapter.operations:
            if not direct:
                lm.former.unexpect()
            raise invalid_input(f"Model '{lm.model_id}' does not support {ctx.op}")
        submitted = time.monotonic()
        if direct:
            outputs: list[Any] = [None] * len(units)
            packed = lm.adapter.runs_packed(ctx)
            for chunk in chunk_by_cost(units, lm.max_cost, lm.max_requests, self.settings.max_padding_share,
                                       packed=packed):
                started = time.monotonic()
                with tracing.span("worker.forward") as span:
                    if span is not None:
                        real, padded = token_counts([units[i] for i in chunk], packed)
                        tracing.set_attributes(span, model=lm.model_id, batch_size=len(chunk), tokens=real,
                                               padding_share=padded / max(1, padded + real))
                    outs = await lm.run(ctx, [units[i] for i in chunk])
                timing.queue_ms = max(timing.queue_ms, (started - submitted) * 1000)
                timing.inference_ms += (time.monotonic() - started) * 1000
                for i, out in zip(chunk, outs, strict=True):
                    outputs[i] = out
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
