"""A deterministic model for tests and CI, with fault injection.

Vectors are derived from a hash of the text (and the query flag), so equal inputs give equal
outputs across processes. Load-time options inject faults:

- ``load_delay_s``: sleep this long while loading (observe MODEL_LOADING)
- ``fail_load``: a message; loading raises it (a permanent failure)
- ``oom_on_batch`` / ``oom_repeat``: dispatch number N (1-based, counting every forward call)
  and the ``oom_repeat`` dispatches after it raise ``torch.OutOfMemoryError``
- ``batch_delay_ms``: sleep this long in every forward call (slow batches)
- ``memory_bytes``: the footprint reported to the memory manager
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from typing import Any

import numpy as np
import torch

from worker.adapters.base import Adapter, InputTooLong, Prepared, RequestContext, apply_template

_WORD = re.compile(r"\w+", re.UNICODE)


class FakeLoadError(RuntimeError):
    pass


def fake_vector(text: str, dim: int, salt: str = "") -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{salt}\x00{text}".encode()).digest()[:8], "little")
    vec = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return vec / np.linalg.norm(vec)


class FakeAdapter(Adapter):
    operations = frozenset({"encode", "score", "extract"})

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.opts = dict(spec.loadtime)
        enc = spec.config.tasks.encode
        self.dim = (enc.dense.dim if enc and enc.dense and enc.dense.dim else None) or 384
        self.sparse_dim = (enc.sparse.dim if enc and enc.sparse and enc.sparse.dim else None) or 30522
        self.mv_dim = (enc.multivector.dim if enc and enc.multivector and enc.multivector.dim else None) or 32
        self._dispatches = 0
        self._lock = threading.Lock()
        self.loaded = False

    def load(self) -> None:
        delay = float(self.opts.get("load_delay_s", 0))
        if delay:
            time.sleep(delay)
        if self.opts.get("fail_load"):
            raise FakeLoadError(str(self.opts["fail_load"]))
        self.loaded = True

    def unload(self) -> None:
        self.loaded = False

    def memory_bytes(self) -> int:
        return int(self.opts.get("memory_bytes", 1_000_000))

    # ---- preparation -----------------------------------------------------------------------
    def _tokens(self, ctx: RequestContext, text: str, index: int) -> list[str]:
        words = _WORD.findall(text.lower())
        limit = min(ctx.max_length or self.max_length, self.max_length) - 2
        if len(words) > limit:
            if not ctx.truncate:
                raise InputTooLong(index, len(words) + 2, limit + 2)
            words = words[:limit]
        return words

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        out = []
        for i, item in enumerate(inputs):
            if ctx.op == "score":
                query, doc = item
                qw = self._tokens(ctx, query.text or "", i)
                dw = self._tokens(ctx, doc.text or "", i)
                out.append(
                    Prepared(cost=len(qw) + len(dw) + 3, data=(qw, dw), input_tokens=len(qw) + len(dw) + 3)
                )
            else:
                text = apply_template(item.text or "", ctx) if ctx.op == "encode" else item.text or ""
                words = self._tokens(ctx, text, i)
                out.append(Prepared(cost=len(words) + 2, data=(text, words), input_tokens=len(words) + 2))
        return out

    # ---- forward ---------------------------------------------------------------------------
    def _dispatch_faults(self) -> None:
        with self._lock:
            self._dispatches += 1
            n = self._dispatches
        first = int(self.opts.get("oom_on_batch", 0))
        repeat = int(self.opts.get("oom_repeat", 1))
        if first and first <= n < first + repeat:
            raise torch.OutOfMemoryError(f"fake OOM on dispatch {n}")
        delay = float(self.opts.get("batch_delay_ms", 0))
        if delay:
            time.sleep(delay / 1000.0)

    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[Any]:
        self._dispatch_faults()
        if ctx.op == "encode":
            return [self._encode(ctx, p) for p in batch]
        if ctx.op == "score":
            return [self._score(p) for p in batch]
        return [self._extract(ctx, p) for p in batch]

    def _encode(self, ctx: RequestContext, p: Prepared) -> dict[str, Any]:
        text, words = p.data
        salt = "q" if ctx.is_query and ctx.options.get("asymmetric") else ""
        out: dict[str, Any] = {}
        if "dense" in ctx.output_types:
            out["dense"] = fake_vector(text, self.dim, salt)
        if "sparse" in ctx.output_types:
            ids = sorted({int(hashlib.md5(w.encode()).hexdigest()[:8], 16) % self.sparse_dim for w in words})
            idx = np.array(ids, dtype=np.int32)
            out["sparse"] = (idx, np.ones(len(idx), dtype=np.float32))
        if "multivector" in ctx.output_types:
            rows = [fake_vector(w, self.mv_dim) for w in words] or [fake_vector(text, self.mv_dim)]
            out["multivector"] = np.stack(rows).astype(np.float32)
        return out

    def _score(self, p: Prepared) -> float:
        qw, dw = p.data
        q, d = set(qw), set(dw)
        overlap = len(q & d) / (len(q) or 1)
        jitter = fake_vector(" ".join(qw) + "\x01" + " ".join(dw), 1)[0] * 1e-3
        return float(overlap + jitter)

    def _extract(self, ctx: RequestContext, p: Prepared) -> dict[str, Any]:
        text, _ = p.data
        label = ctx.labels[0] if ctx.labels else "entity"
        entities = [
            {"text": m.group(0), "label": label, "score": 0.9, "start": m.start(), "end": m.end()}
            for m in re.finditer(r"\b[A-Z]\w+", text)
        ]
        return {"entities": entities}
