"""Shared by the framework adapters: batching texts through ``encode`` into plain float lists, and
ranking texts through ``score``."""

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


def score_call(
    query: str, texts: Sequence[str], *, options: dict[str, Any] | None, gpu: str | None
) -> tuple[dict[str, str], list[dict[str, str]], dict[str, Any]]:
    """(query item, items with their positions as ids, keyword arguments) of one ``score`` call."""
    kwargs: dict[str, Any] = {}
    if options:
        kwargs["options"] = dict(options)
    if gpu is not None:
        kwargs["gpu"] = gpu
    return {"text": query}, [{"id": str(i), "text": t} for i, t in enumerate(texts)], kwargs


def ranking(result: dict[str, Any], top_n: int | None) -> list[tuple[int, float]]:
    """(input position, score) by descending score (ties in input order), at most ``top_n``."""
    ranked = sorted(
        ((int(e["item_id"]), float(e["score"])) for e in result["scores"]), key=lambda p: (-p[1], p[0])
    )
    return ranked if top_n is None else ranked[: max(0, int(top_n))]
