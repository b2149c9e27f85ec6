"""What the runtime hands back: per-request results and timing, score ranking, extract items."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.api import Item
from protocol.errors import ErrorCode, SIEError
from worker.adapters.base import Prepared


@dataclass
class Timing:
    queue_ms: float = 0.0
    tokenization_ms: float = 0.0
    inference_ms: float = 0.0
    postprocessing_ms: float = 0.0
    total_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "total_ms": round(self.total_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "tokenization_ms": round(self.tokenization_ms, 3),
            "inference_ms": round(self.inference_ms, 3),
            "postprocessing_ms": round(self.postprocessing_ms, 3),
        }


@dataclass
class Result:
    """What one request produced: per-item outputs (or score entries), timing and token usage."""

    items: list[Any]
    timing: Timing
    input_tokens: int = 0
    query_id: str | None = None
    item_tokens: list[int] | None = None  # per item (encode, extract): the cluster path reports each


def truncation(unit: Prepared) -> dict[str, Any]:
    """What a result entry says when truncation shortened its input: ``truncated: true``, the
    input's ``input_tokens`` before and the ``used_tokens`` the model saw; nothing otherwise."""
    if not unit.truncated:
        return {}
    return {"truncated": True, "input_tokens": unit.full_tokens, "used_tokens": unit.input_tokens}


def rank_scores(
    scores: list[float],
    items: Sequence[Item],
    units: list[Prepared],
    extra: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Score entries by descending score; ``extra``: more fields per item (in item order)."""
    values = [float(s) for s in scores]
    if not all(math.isfinite(v) for v in values):
        raise SIEError(ErrorCode.INFERENCE_ERROR, "the model produced non-finite scores")
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return [
        {
            "item_id": items[i].id or f"item-{i}",
            "score": values[i],
            "rank": rank,
            **truncation(units[i]),
            **(extra[i] if extra else {}),
        }
        for rank, i in enumerate(order)
    ]


def extract_item(raw: dict[str, Any], item: Item, index: int, unit: Prepared) -> dict[str, Any]:
    out = {
        "id": item.id or f"item-{index}",
        "entities": list(raw.get("entities") or []),
        "relations": list(raw.get("relations") or []),
        "classifications": list(raw.get("classifications") or []),
        "objects": list(raw.get("objects") or []),
        "data": dict(raw.get("data") or {}),
    }
    if raw.get("error"):
        out["error"] = raw["error"]
    out.update(truncation(unit))
    return out
