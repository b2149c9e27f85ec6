"""Image and text into one embedding space (CLIP, SigLIP) for ``encode``.

An item with ``images`` is embedded from its first image, an item with only ``text`` from its
text; both land in the same space, so text queries find images and the other way round. Images
are decoded and preprocessed (Pillow, then the checkpoint's image processor: resize, crop,
normalise) in the CPU pool like tokenisation, and cost 1 unit each in the batcher. A forward
pass runs the image tower on the batch's images and the text tower on its texts.

Load-time options: ``max_image_bytes`` (default 20 MiB) and ``max_image_pixels`` (default 40 M)
bound what is decoded (400 INVALID_INPUT above, naming the item, before any pixel is decoded
when the header tells the size); ``text_padding: max_length`` pads every text to the model's
window as SigLIP was trained, and ``text_attention_mask: false`` leaves the mask out as SigLIP
does. A corrupt image fails its request with 400, never the batch it would have joined.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
import torch

from protocol.api import Item
from protocol.errors import invalid_input
from worker.adapters.base import Prepared, RequestContext, apply_template
from worker.adapters.hf import HFTextAdapter

IMAGE, TEXT = "image", "text"


def image_bytes(item: Item, index: int, limit: int) -> bytes:
    """The first image of ``item`` as bytes: ``{"data": bytes | base64 str, "format": ...}``
    (the contract's shape), or bare bytes / a base64 string."""
    images = item.images
    if not images:
        raise invalid_input(f"Item {index}: images must be a non-empty list", param=f"items.{index}.images")
    first = images[0]
    data = first.get("data") if isinstance(first, dict) else first
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise invalid_input(
                f"Item {index}: image data is not valid base64", param=f"items.{index}.images"
            ) from None
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise invalid_input(f"Item {index}: image data must be bytes", param=f"items.{index}.images")
    if len(data) > limit:
        raise invalid_input(
            f"Item {index}: image of {len(data)} bytes exceeds the limit of {limit}",
            param=f"items.{index}.images",
        )
    return bytes(data)


def decode_image(data: bytes, index: int, max_pixels: int) -> Any:
    """An RGB PIL image; 400 for what Pillow cannot read or what is larger than ``max_pixels``."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:  # from the header, before the pixels are decoded
            raise invalid_input(
                f"Item {index}: image of {img.width}x{img.height} pixels exceeds the limit of {max_pixels}",
                param=f"items.{index}.images",
            )
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise invalid_input(
            f"Item {index}: image cannot be decoded ({exc})", param=f"items.{index}.images"
        ) from None


def image_limits(loadtime: dict[str, Any]) -> tuple[int, int]:
    """The load-time options ``max_image_bytes`` (default 20 MiB) and ``max_image_pixels`` (40 M)."""
    return (
        int(loadtime.get("max_image_bytes") or 20 * 1024 * 1024),
        int(loadtime.get("max_image_pixels") or 40_000_000),
    )


def first_image(item: Item, index: int, max_bytes: int, max_pixels: int) -> Any:
    """The first image of ``item`` decoded to RGB within the limits; 400 naming the item otherwise."""
    return decode_image(image_bytes(item, index, max_bytes), index, max_pixels)


def load_image_processor(path: str) -> Any:
    """The checkpoint's image processor, on its Pillow backend: transformers' default backend (and
    its AutoImageProcessor) needs torchvision, which the worker does without."""
    import json
    from pathlib import Path

    import transformers

    name = json.loads((Path(path) / "preprocessor_config.json").read_text()).get("image_processor_type") or ""
    name = name.removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, f"{name}Pil", None) or getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"unknown image processor {name!r} in {path}/preprocessor_config.json")
    return cls.from_pretrained(path)


class CLIPAdapter(HFTextAdapter):
    operations = frozenset({"encode"})

    def load(self) -> None:
        from transformers import AutoModel

        self.load_model(AutoModel)
        self.image_processor = load_image_processor(self.spec.weights_dir or "")
        opts = self.spec.loadtime
        self.max_image_bytes, self.max_image_pixels = image_limits(opts)
        self.pad_to_window = opts.get("text_padding") == "max_length"
        self.text_mask = bool(opts.get("text_attention_mask", True))

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        units: list[Prepared | None] = [None] * len(inputs)
        texts, text_at = [], []
        for i, item in enumerate(inputs):
            if item.images:
                img = first_image(item, i, self.max_image_bytes, self.max_image_pixels)
                pixels = self.image_processor(images=img, return_tensors="np")["pixel_values"][0]
                units[i] = Prepared(cost=1, data=(IMAGE, pixels.astype(np.float32)))
            else:
                texts.append(apply_template(item.text or "", ctx))
                text_at.append(i)
        if texts:
            for i, unit in zip(text_at, self.tokenize(ctx, texts), strict=True):
                units[i] = Prepared(cost=unit.cost, data=(TEXT, unit.data), input_tokens=unit.input_tokens)
        return [u for u in units if u is not None]

    @staticmethod
    def _features(out: Any) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 5 returns an output

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        device = self.spec.device
        dtype = next(self.model.parameters()).dtype
        vectors: list[torch.Tensor | None] = [None] * len(batch)
        images = [i for i, p in enumerate(batch) if p.data[0] == IMAGE]
        texts = [i for i, p in enumerate(batch) if p.data[0] == TEXT]
        if images:
            pixels = torch.from_numpy(np.stack([batch[i].data[1] for i in images])).to(device, dtype)
            feats = self._features(self.model.get_image_features(pixel_values=pixels))
            for row, i in enumerate(images):
                vectors[i] = feats[row]
        if texts:
            seqs = [Prepared(cost=len(batch[i].data[1]), data=batch[i].data[1]) for i in texts]
            ids, mask = self.pad(seqs, width=self.max_length if self.pad_to_window else None)
            kwargs = {"attention_mask": mask} if self.text_mask else {}
            feats = self._features(self.model.get_text_features(input_ids=ids, **kwargs))
            for row, i in enumerate(texts):
                vectors[i] = feats[row]
        out = torch.stack([v for v in vectors if v is not None]).float()
        if ctx.options.get("normalize", True):
            out = torch.nn.functional.normalize(out, p=2, dim=-1)
        rows = out.cpu().numpy()
        return [{"dense": rows[i]} for i in range(len(batch))]
