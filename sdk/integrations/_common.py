"""Shared by the framework adapters: batching texts through ``encode`` into plain float lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_kwargs(
    *, is_query: bool, instruction: str | None, options: dict[str, Any] | None, gpu: str | None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"output_types": ["dense"], "is_query": is_query}
    if instruction is not None:
        kwargs["instruction"] = instruction
    if options:
        kwargs["options"] = dict(options)
    if gpu is not None:
        kwargs["gpu"] = gpu
    return kwargs


def batches(texts: Sequence[str], size: int) -> list[list[dict[str, str]]]:
    size = max(1, int(size))
    return [[{"text": t} for t in texts[i : i + size]] for i in range(0, len(texts), size)]


def vectors(results: list[dict[str, Any]]) -> list[list[float]]:
    return [[float(x) for x in r["dense"].astype("float32").tolist()] for r in results]
