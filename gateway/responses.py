"""Turning per-item WorkResults into one HTTP answer.

msgpack answers splice the workers' already-msgpacked item results into the envelope without
decoding them; JSON answers decode them and expand arrays into lists.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgpack

from protocol.api import usage as usage_map
from protocol.codec import packb, to_jsonable, unpackb
from protocol.errors import RETRYABLE_CODES, ErrorCode, SIEError, default_status
from protocol.work import WorkResult

_KNOWN_CODES = {c.value for c in ErrorCode}


def _error_from(result: WorkResult) -> SIEError:
    code = result.error_code or ErrorCode.INFERENCE_ERROR
    if code not in _KNOWN_CODES:
        code = ErrorCode.INFERENCE_ERROR
    extra = dict(result.error_extra or {})
    kwargs: dict[str, Any] = {}
    if result.retry_after_s is not None and code in RETRYABLE_CODES:
        kwargs["retry_after"] = max(1.0, min(60.0, float(result.retry_after_s)))
    return SIEError(code, result.error or f"item {result.item_index} failed", **kwargs, **extra)


def check_failures(results: list[WorkResult], *, allow_item_errors: bool = False) -> set[int]:
    """Raise the request-level error that the failed items call for.

    Any retryable failure fails the whole request with that code (the client retries all of it);
    identical failures surface their own code and status; mixed ones a 500 listing each item. With
    ``allow_item_errors`` (extract) and some items successful, non-retryable failures are returned as
    indexes to be answered with a per-item ``error`` entry instead.
    """
    failures = [r for r in results if not r.success]
    if not failures:
        return set()
    for r in failures:
        if r.error_code in RETRYABLE_CODES:
            raise _error_from(r)
    if allow_item_errors and len(failures) < len(results):
        return {r.item_index for r in failures}
    codes = {r.error_code or ErrorCode.INFERENCE_ERROR for r in failures}
    if len(codes) == 1:
        err = _error_from(failures[0])
        if len(failures) > 1:
            err.message = f"{len(failures)} of {len(results)} items failed: {err.message}"
        return _raise(err)
    details = [{"item_index": r.item_index, "code": r.error_code, "error": r.error} for r in failures[:100]]
    raise SIEError(
        ErrorCode.INFERENCE_ERROR,
        f"{len(failures)} of {len(results)} items failed",
        status=default_status(ErrorCode.INFERENCE_ERROR),
        details=details,
    )


def _raise(err: SIEError) -> set[int]:
    raise err


def timing(results: list[WorkResult], total_ms: float) -> dict[str, float]:
    """The answer's timing: each stage's longest time over the items (one pass over them)."""
    queue = tokenization = inference = post = 0.0
    for r in results:
        queue = max(queue, r.queue_ms or 0.0)
        tokenization = max(tokenization, r.tokenization_ms or 0.0)
        inference = max(inference, r.inference_ms or 0.0)
        post = max(post, r.postprocessing_ms or 0.0)
    out = {
        "total_ms": round(total_ms, 3),
        "queue_ms": float(queue),
        "tokenization_ms": float(tokenization),
        "inference_ms": float(inference),
    }
    if post > 0:
        out["postprocessing_ms"] = float(post)
    return out


def input_tokens(results: list[WorkResult]) -> int | None:
    counts = [r.input_tokens for r in results]
    if not counts or any(c is None for c in counts):
        return None
    return int(sum(counts))  # type: ignore[arg-type]


def usage(results: list[WorkResult]) -> dict[str, int]:
    """The answer's ``usage``: input tokens when every item counted them, and the truncation totals."""
    return usage_map(
        input_tokens(results), sum(r.truncated_items for r in results), sum(r.dropped_tokens for r in results)
    )


class ItemError(TypedDict):
    code: str
    message: str


class FailedItem(TypedDict):
    """A failed item's place in an answer (extract's shape, with its error)."""

    id: str
    entities: list[object]
    relations: list[object]
    classifications: list[object]
    objects: list[object]
    data: dict[str, object]
    error: ItemError


def _error_item(result: WorkResult) -> FailedItem:
    return {
        "id": f"item-{result.item_index}",
        "entities": [],
        "relations": [],
        "classifications": [],
        "objects": [],
        "data": {},
        "error": {
            "code": result.error_code or ErrorCode.INFERENCE_ERROR.value,
            "message": result.error or "item failed",
        },
    }


def items_msgpack(
    model: str,
    results: list[WorkResult],
    timing_map: dict[str, float],
    item_errors: set[int] = frozenset(),  # type: ignore[assignment]
) -> bytes:
    packer = msgpack.Packer(use_bin_type=True)
    parts = [
        packer.pack_map_header(4),
        packer.pack("model"),
        packer.pack(model),
        packer.pack("items"),
        packer.pack_array_header(len(results)),
    ]
    for r in results:
        if r.item_index in item_errors or not r.result_msgpack:
            parts.append(packb(_error_item(r)))
        else:
            parts.append(bytes(r.result_msgpack))
    parts += [packer.pack("timing"), packb(timing_map), packer.pack("usage"), packb(usage(results))]
    return b"".join(parts)


def items_json(
    model: str,
    results: list[WorkResult],
    timing_map: dict[str, float],
    item_errors: set[int] = frozenset(),  # type: ignore[assignment]
) -> dict[str, Any]:
    items = []
    for r in results:
        if r.item_index in item_errors or not r.result_msgpack:
            items.append(_error_item(r))
        else:
            items.append(to_jsonable(unpackb(r.result_msgpack)))
    return {"model": model, "items": items, "timing": timing_map, "usage": usage(results)}


def _map_header(blob: bytes) -> tuple[int, int] | None:
    """(entry count, header length) of a msgpack map at the start of ``blob``; None if not a map."""
    if not blob:
        return None
    b = blob[0]
    if 0x80 <= b <= 0x8F:
        return b & 0x0F, 1
    if b == 0xDE and len(blob) >= 3:
        return int.from_bytes(blob[1:3], "big"), 3
    if b == 0xDF and len(blob) >= 5:
        return int.from_bytes(blob[1:5], "big"), 5
    return None


def score_msgpack(model: str, result: WorkResult, timing_map: dict[str, float]) -> bytes:
    """``{model, timing, <the worker's map entries>}``: the worker's score map spliced in undecoded."""
    packer = msgpack.Packer(use_bin_type=True)
    blob = bytes(result.result_msgpack or b"")
    head = _map_header(blob)
    prefix = [
        packer.pack("model"),
        packer.pack(model),
        packer.pack("timing"),
        packb(timing_map),
        packer.pack("usage"),
        packb(usage([result])),
    ]
    if head is None:  # a bare list of score entries
        return b"".join([packer.pack_map_header(4), *prefix, packer.pack("scores"), blob or packb([])])
    count, hlen = head
    return b"".join([packer.pack_map_header(count + 3), *prefix, blob[hlen:]])


def score_json(model: str, result: WorkResult, timing_map: dict[str, float]) -> dict[str, Any]:
    decoded = unpackb(result.result_msgpack) if result.result_msgpack else {}
    if not isinstance(decoded, dict):
        decoded = {"scores": decoded}
    out = {"model": model, "timing": timing_map, "usage": usage([result])}
    out.update(to_jsonable(decoded))
    out["model"] = model
    return out
