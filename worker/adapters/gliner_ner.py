"""Zero-shot named-entity extraction with GLiNER (the ``gliner`` package) for ``extract``.

The request's ``labels`` are the entity types. Runtime options: ``threshold`` (default 0.5),
``flat_ner`` (default true), ``multi_label`` (default false). Entities come back with
character offsets into the item's text (``text[start:end] == entity text``). Texts longer than
the model's word window (``max_len`` in ``gliner_config.json``) are truncated by GLiNER unless
``overflow_policy`` is ``error`` (then ``INPUT_TOO_LONG``). If one item of a batch fails inside
GLiNER, the others still answer and that item carries ``error: {code, message}``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from protocol.errors import ErrorCode, invalid_input
from worker.adapters.base import Adapter, InputTooLong, Prepared, RequestContext, is_oom
from worker.adapters.hf import torch_dtype

log = logging.getLogger(__name__)


class GLiNERAdapter(Adapter):
    operations = frozenset({"extract"})

    def load(self) -> None:
        from gliner import GLiNER

        device = self.spec.device
        self.model = GLiNER.from_pretrained(self.spec.weights_dir, load_tokenizer=True, map_location=device)
        dtype = torch_dtype(self.spec.precision, device)
        if device.startswith("cuda") and dtype != torch.float32:
            self.model.to(dtype)
        self.model.to(device).eval()
        self.max_words = int(getattr(self.model.config, "max_len", 384) or 384)
        self.splitter = self.model.data_processor.words_splitter

    def unload(self) -> None:
        self.model = None

    def memory_bytes(self) -> int:
        model = getattr(self, "model", None)
        return sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        if not ctx.labels:
            raise invalid_input("GLiNER extraction needs 'labels' (the entity types to find)", param="labels")
        limit = min(ctx.max_length or self.max_words, self.max_words)
        out = []
        for i, item in enumerate(inputs):
            text = item.text or ""
            words = sum(1 for _ in self.splitter(text))
            if words > limit and not ctx.truncate:
                raise InputTooLong(i, words, limit)
            n = min(words, limit)
            # the prompt carries two tokens per label ([ENT] + label words) ahead of the text
            out.append(
                Prepared(
                    cost=n + 2 * len(ctx.labels) + 2,
                    data=text,
                    input_tokens=n,
                    full_tokens=words if words > n else 0,
                )
            )
        return out

    def _predict(self, ctx: RequestContext, texts: list[str]) -> list[list[dict[str, Any]]]:
        opts = ctx.options
        return self.model.inference(
            texts,
            list(ctx.labels),
            flat_ner=bool(opts.get("flat_ner", True)),
            threshold=float(opts.get("threshold", 0.5)),
            multi_label=bool(opts.get("multi_label", False)),
            batch_size=max(1, len(texts)),
        )

    @staticmethod
    def _entities(found: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "entities": [
                {
                    "text": e["text"],
                    "label": e["label"],
                    "score": float(e["score"]),
                    "start": int(e["start"]),
                    "end": int(e["end"]),
                    "bbox": None,
                }
                for e in found
            ]
        }

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        texts = [p.data for p in batch]
        try:
            return [self._entities(found) for found in self._predict(ctx, texts)]
        except Exception as exc:
            if is_oom(exc) or len(texts) == 1:
                if is_oom(exc):
                    raise
                return [self._item_error(exc)]
            log.warning("GLiNER batch of %d failed (%s); running items one by one", len(texts), exc)
        out = []
        for text in texts:
            try:
                out.append(self._entities(self._predict(ctx, [text])[0]))
            except Exception as exc:
                if is_oom(exc):
                    raise
                out.append(self._item_error(exc))
        return out

    @staticmethod
    def _item_error(exc: Exception) -> dict[str, Any]:
        log.warning("GLiNER failed on an item: %s", exc)
        return {"error": {"code": str(ErrorCode.INFERENCE_ERROR), "message": f"extraction failed: {exc}"}}
