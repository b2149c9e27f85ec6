"""One answer for equal items: identical inputs of a request are computed once, and an answer made
for one item (by a worker, or kept in the result cache) is handed to another as that item's own.

Within a request every parameter is shared, so two items are the same work when their inputs are
equal: the item maps as sent (their msgpack bytes; an ``id`` differing makes them different, as it
is echoed in the answer). A score request is one item: nothing to merge.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

from protocol.api import Item
from protocol.codec import packb, unpackb
from protocol.jobs import JobItem
from protocol.work import WorkResult
from protocol.work_codec import item_map

#: stands in a request's slots for an item whose answer is copied from an equal one when it comes
COPY = WorkResult(work_item_id="", request_id="", item_index=-1, success=False)


def duplicates(items: Sequence[JobItem], known: Sequence[WorkResult | None]) -> dict[int, int]:
    """``{index: index of the first equal item}`` over the items not ``known`` yet (one pass)."""
    first: dict[bytes, int] = {}
    same: dict[int, int] = {}
    for i, item in enumerate(items):
        if known[i] is not None or not isinstance(item.input, Item):
            continue
        key = packb(item_map(item.input))
        j = first.setdefault(key, i)
        if j != i:
            same[i] = j
    return same


def answer_for(result: WorkResult, item: JobItem) -> WorkResult:
    """``result`` (made for an equal item) as the answer of ``item``: its index and id. An extract
    answer names its item; without an ``id`` of its own that name is ``item-<index>``."""
    answer = dataclasses.replace(result, work_item_id=item.work_item_id, item_index=item.index)
    named = isinstance(item.input, Item) and item.input.id
    if item.job.operation == "extract" and result.result_msgpack and not named:
        body = unpackb(result.result_msgpack)
        if isinstance(body, dict) and body.get("id") != f"item-{item.index}":
            body["id"] = f"item-{item.index}"
            answer.result_msgpack = packb(body)
    return answer


class InFlight:
    """The result-cache misses this gateway is computing, by cache key: a concurrent request with an
    equal miss waits for that answer instead of computing it again (single flight). A computation
    that fails or is abandoned hands its followers nothing, and they compute it themselves."""

    def __init__(self, on_follow: Callable[[], None] = lambda: None) -> None:
        self._answers: dict[str, asyncio.Future[WorkResult | None]] = {}
        self.on_follow = on_follow  # counts each miss that waits for another's computation

    def claim(
        self, keys: Sequence[str | None], known: Sequence[WorkResult | None]
    ) -> tuple[dict[int, asyncio.Future[WorkResult | None]], list[str]]:
        """For each item not ``known`` with a key: follow the computation in flight, or lead it.
        Returns ``({index: answer to wait for}, keys led)``."""
        followed: dict[int, asyncio.Future[WorkResult | None]] = {}
        led: list[str] = []
        for i, key in enumerate(keys):
            if key is None or known[i] is not None:
                continue
            answer = self._answers.get(key)
            if answer is not None:
                followed[i] = answer
                self.on_follow()
            else:
                self._answers[key] = asyncio.get_running_loop().create_future()
                led.append(key)
        return followed, led

    def settle(
        self, led: list[str], keys: Sequence[str | None], results: Sequence[WorkResult] | None
    ) -> None:
        """The answers of the keys led (a failed one, or none when ``results`` is None, as None)."""
        by_key: dict[str, WorkResult] = {}
        for i, key in enumerate(keys):
            if key is not None and results is not None and results[i].success:
                by_key.setdefault(key, results[i])
        for key in led:
            answer = self._answers.pop(key, None)
            if answer is not None and not answer.done():
                answer.set_result(by_key.get(key))

    @staticmethod
    async def follow(
        followed: dict[int, asyncio.Future[WorkResult | None]], deadline: float
    ) -> dict[int, WorkResult | None]:
        """Each followed answer, None where it failed or did not come by ``deadline`` (monotonic)."""
        out: dict[int, WorkResult | None] = {}
        for i, answer in followed.items():
            with contextlib.suppress(TimeoutError):
                out[i] = await asyncio.wait_for(asyncio.shield(answer), max(0.0, deadline - time.monotonic()))
            out.setdefault(i, None)
        return out
