"""Media items into the wire form ``{"data": bytes, "format": str}`` (what the public sie-sdk does).

PIL images and numpy arrays become JPEG (quality 95); file paths are read; bytes pass through,
their format sniffed from the file signature. A dict already in wire form is kept. Pillow is
imported only when an image or array has to be encoded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, TypedDict, cast

SIGNATURES = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)


def sniff_format(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((fmt for sig, fmt in SIGNATURES if data.startswith(sig)), None)


def _jpeg(image: Any) -> bytes:
    out = io.BytesIO()
    image.convert("RGB").save(out, format="JPEG", quality=95)
    return out.getvalue()


class WireImage(TypedDict):
    """An image as the servers read it: its encoded bytes and their format (``None``: unknown)."""

    data: bytes
    format: str | None


def to_wire_image(value: Any) -> WireImage:
    """One image (PIL image, numpy array, path, bytes or wire dict) as ``{"data", "format"}``."""
    if isinstance(value, Mapping) and "data" in value:
        return cast(WireImage, dict(value))  # already in wire form: sent as the caller wrote it
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return {"data": data, "format": sniff_format(data)}
    if isinstance(value, (str, os.PathLike)):
        with open(value, "rb") as f:
            data = f.read()
        return {"data": data, "format": sniff_format(data)}
    module = type(value).__module__
    if module.startswith("PIL."):
        return {"data": _jpeg(value), "format": "jpeg"}
    if module.startswith("numpy"):
        from PIL import Image

        return {"data": _jpeg(Image.fromarray(value)), "format": "jpeg"}
    raise TypeError(
        f"cannot send a {type(value).__name__} as an image: use a PIL image, an array, a path or bytes"
    )


def convert_item(item: Any) -> Any:
    """An item with its ``images`` in wire form (a single image may stand for a list of one)."""
    if not isinstance(item, Mapping) or item.get("images") is None:
        return item
    images = item["images"]
    if not isinstance(images, (list, tuple)):
        images = [images]
    return {**item, "images": [to_wire_image(i) for i in images]}
