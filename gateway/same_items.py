"""One answer for equal items: identical inputs of a request are computed once, and an answer made
for one item (by a worker, or kept in the result cache) is handed to another as that item's own.

Within a request every parameter is shared, so two items are the same work when their inputs are
equal: the item maps as sent (their msgpack bytes; an ``id`` differing makes them different, as it
is echoed in the answer). Items that travel by reference (``payload_ref``) are never merged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from protocol.codec import packb, unpackb
from protocol.work import WorkItem, WorkResult

#: stands in a request's slots for an item whose answer is copied from an equal one when it comes
COPY = WorkResult(work_item_id="", request_id="", item_index=-1, success=False)


def duplicates(items: Sequence[WorkItem], known: Sequence[WorkResult | None]) -> dict[int, int]:
    """``{index: index of the first equal item}`` over the items not ``known`` yet (one pass)."""
    first: dict[bytes, int] = {}
    same: dict[int, int] = {}
    for i, item in enumerate(items):
        if known[i] is not None or item.item is None or item.payload_ref:
            continue
        key = packb(item.item)
        j = first.setdefault(key, i)
        if j != i:
            same[i] = j
    return same


def answer_for(result: WorkResult, item: WorkItem) -> WorkResult:
    """``result`` (made for an equal item) as the answer of ``item``: its index and id. An extract
    answer names its item; without an ``id`` of its own that name is ``item-<index>``."""
    answer = dataclasses.replace(result, work_item_id=item.work_item_id, item_index=item.item_index)
    if item.operation == "extract" and result.result_msgpack and not (item.item or {}).get("id"):
        body = unpackb(result.result_msgpack)
        if isinstance(body, dict) and body.get("id") != f"item-{item.item_index}":
            body["id"] = f"item-{item.item_index}"
            answer.result_msgpack = packb(body)
    return answer
