"""Visual-document retrieval (ColPali, ColQwen2): page images and text queries as multi-vectors.

The architectures transformers ships natively, ``ColPaliForRetrieval`` (PaliGemma body) and
``ColQwen2ForRetrieval`` (Qwen2-VL body), picked by the checkpoint's ``model_type``, with their
processors (``ColPaliProcessor`` / ``ColQwen2Processor``) on the Pillow image backend.

For ``encode`` (output ``multivector``) an item with ``images`` is a document page: its first image
goes through the processor's image path (the visual prompt around the image tokens) and every
attended position of the model's ``embeddings`` output (projected and L2-normalised by the model)
is one vector, image patches and prompt tokens alike. An item with only ``text`` is a query,
whatever ``is_query`` says (these models have no text-document path): the processor's query
path, with its prefix and its augmentation tokens, all of whose positions are vectors.
``score`` embeds the query and each item that way and answers MaxSim, as ColBERT does.

Images are decoded with CLIP's helpers (load-time options ``max_image_bytes`` and
``max_image_pixels``; a corrupt or oversized image fails its request with 400 INVALID_INPUT
naming the item, never the batch it would have joined) and preprocessed in the CPU pool, each
thread with its own copy of the processor. A unit's cost is its sequence length (an image is
hundreds to a thousand tokens through the language model, so counting it as 1 would let the
batcher stack far too many into one pass). Batches are right-padded: PaliGemma numbers positions
without looking at the mask, so left padding would make an item's vectors depend on its batch.
Queries longer than the model's limit are truncated (or refused under ``overflow_policy: error``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocol.api import Item
from worker.adapters.base import InputTooLong, Prepared, RequestContext, apply_template
from worker.adapters.clip import first_image, image_limits
from worker.adapters.colbert import maxsim
from worker.adapters.hf import HFTextAdapter

# model_type in config.json -> (model class, processor class), both in transformers
FAMILIES = {
    "colpali": ("ColPaliForRetrieval", "ColPaliProcessor"),
    "colqwen2": ("ColQwen2ForRetrieval", "ColQwen2Processor"),
}
SEQUENCE_KEYS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class Page:
    """One unpadded model input: per-position arrays (``SEQUENCE_KEYS``) and, for an image,
    ``pixel_values`` (and ColQwen2's ``image_grid_thw``)."""

    arrays: dict[str, np.ndarray]

    @property
    def length(self) -> int:
        return len(self.arrays["input_ids"])

    @property
    def is_image(self) -> bool:
        return "pixel_values" in self.arrays


def model_type(path: str) -> str:
    kind = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{path}: model_type {kind!r} is not a visual retriever ({', '.join(FAMILIES)})")
    return str(kind)


class ColPaliAdapter(HFTextAdapter):
    operations = frozenset({"encode", "score"})

    processor: Any = None

    def load(self) -> None:
        import transformers

        path = self.spec.weights_dir or ""
        kind = model_type(path)
        model_cls, processor_cls = (getattr(transformers, name) for name in FAMILIES[kind])
        # the Pillow backend: the default one (torchvision) is not installed on workers
        self.processor = processor_cls.from_pretrained(path, backend="pil")
        self.load_tokenizer(self.processor.tokenizer)
        kwargs = self.model_kwargs()
        if kind == "colpali":
            # PaliGemma builds its own prefix mask from token_type_ids (bidirectional over the
            # image and prompt); SDPA takes that mask as given, flash-attn's kernels would not
            kwargs["attn_implementation"] = "sdpa"
        self.model = model_cls.from_pretrained(path, **kwargs)
        self.model.to(self.spec.device).eval()
        self.max_image_bytes, self.max_image_pixels = image_limits(self.spec.loadtime)

    def unload(self) -> None:
        super().unload()
        self.processor = None

    def _thread_processor(self) -> Any:
        """This thread's own processor (its tokenizer carries padding/truncation state)."""
        proc = getattr(self._local, "processor", None)
        if proc is None:
            proc = self._local.processor = copy.deepcopy(self.processor)
        return proc

    # ---- preparation (CPU pool) ------------------------------------------------------------
    def _unit(self, ctx: RequestContext, item: Item, index: int) -> Prepared:
        proc = self._thread_processor()
        if item.images:
            img = first_image(item, index, self.max_image_bytes, self.max_image_pixels)
            page = self._page(proc(images=[img]))
            return Prepared(cost=page.length, data=page, input_tokens=page.length)
        page = self._page(proc(text=[apply_template(item.text or "", ctx)]))
        n, limit = page.length, self.limit(ctx)
        if n <= limit:
            return Prepared(cost=n, data=page, input_tokens=n)
        if not ctx.truncate:
            raise InputTooLong(index, n, limit)
        page.arrays = {k: v[:limit] if k in SEQUENCE_KEYS else v for k, v in page.arrays.items()}
        return Prepared(cost=limit, data=page, input_tokens=limit, full_tokens=n)

    @staticmethod
    def _page(enc: Any) -> Page:
        """The processor's answer for one input, unbatched, as numpy."""
        keys = [*SEQUENCE_KEYS, "pixel_values", "image_grid_thw"]
        arrays = {k: enc[k][0].numpy() for k in keys if enc.get(k) is not None}
        if "pixel_values" in arrays:
            arrays["pixel_values"] = arrays["pixel_values"].astype(np.float32, copy=False)
        return Page(arrays)

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        if ctx.op != "score":
            return [self._unit(ctx, item, i) for i, item in enumerate(inputs)]
        queries: dict[int, Prepared] = {}  # one preparation (and one Page) per query object
        units = []
        for i, (query, item) in enumerate(inputs):
            q = queries.get(id(query))
            if q is None:
                q = queries[id(query)] = self._unit(ctx, query, i)
            d = self._unit(ctx, item, i)
            units.append(Prepared(
                cost=q.cost + d.cost, data=(q.data, d.data), input_tokens=q.input_tokens + d.input_tokens,
                full_tokens=(q.full_tokens or q.input_tokens) + (d.full_tokens or d.input_tokens)
                if q.truncated or d.truncated else 0,
            ))  # fmt: skip
        return units

    # ---- forward (inference thread) --------------------------------------------------------
    def _run(self, pages: list[Page]) -> list[torch.Tensor]:
        """One forward pass over pages of one modality: each page's valid vectors (float32)."""
        device = self.spec.device
        width = max(p.length for p in pages)
        inputs: dict[str, torch.Tensor] = {}
        for key in SEQUENCE_KEYS:
            if all(key in p.arrays for p in pages):
                arr = np.full((len(pages), width), self.pad_id if key == "input_ids" else 0, dtype=np.int64)
                for row, p in enumerate(pages):
                    arr[row, : p.length] = p.arrays[key]
                inputs[key] = torch.from_numpy(arr).to(device)
        if pages[0].is_image:
            # ColQwen2's patches per image vary: padded to the most, as its processor does
            pixels = [p.arrays["pixel_values"] for p in pages]
            most = max(x.shape[0] for x in pixels)
            stacked = np.stack([np.pad(x, [(0, most - len(x))] + [(0, 0)] * (x.ndim - 1)) for x in pixels])
            inputs["pixel_values"] = torch.from_numpy(stacked).to(device, next(self.model.parameters()).dtype)
            if all("image_grid_thw" in p.arrays for p in pages):
                grids = np.stack([p.arrays["image_grid_thw"] for p in pages]).astype(np.int64)
                inputs["image_grid_thw"] = torch.from_numpy(grids).to(device)
        emb = self.model(**inputs).embeddings.float()
        out = []
        for row, p in enumerate(pages):
            valid = torch.from_numpy(p.arrays["attention_mask"].astype(bool)).to(device)
            out.append(emb[row, : p.length][valid])
        return out

    def _embed(self, pages: list[Page]) -> list[torch.Tensor]:
        """Vectors per page, images and texts in separate passes (their lengths differ widely)."""
        out: list[torch.Tensor | None] = [None] * len(pages)
        for image in (True, False):
            rows = [i for i, p in enumerate(pages) if p.is_image == image]
            if rows:
                for i, vecs in zip(rows, self._run([pages[i] for i in rows]), strict=True):
                    out[i] = vecs
        return [v for v in out if v is not None]

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[Any]:
        if ctx.op == "score":
            queries = {id(p.data[0]): p.data[0] for p in batch}
            qvecs = dict(zip(queries, self._embed(list(queries.values())), strict=True))
            dvecs = self._embed([p.data[1] for p in batch])
            return [float(maxsim(qvecs[id(p.data[0])], d)) for p, d in zip(batch, dvecs, strict=True)]
        return [{"multivector": v.cpu().numpy()} for v in self._embed([p.data for p in batch])]
