"""The sidecar path: NATS work items in, one WorkResult per item out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from protocol.api import (
    EncodeParams,
    ExtractParams,
    Item,
    ScoreParams,
    TokenizeParams,
    parse_item,
    truncation_totals,
)
from protocol.codec import packb
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.priority import INTERACTIVE
from protocol.work import WorkItem, WorkResult
from worker.runtime.results import Result, Timing

log = logging.getLogger("worker.runtime")


class SupportsOperations(Protocol):
    """What runs the work items (:class:`worker.runtime.operations.Operations`)."""

    async def encode(
        self,
        spec: str,
        items: Sequence[Item],
        params: EncodeParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def score(
        self,
        spec: str,
        query: Item,
        items: Sequence[Item],
        params: ScoreParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def extract(
        self,
        spec: str,
        items: Sequence[Item],
        params: ExtractParams | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def tokenize(
        self, spec: str, items: Sequence[Item], params: TokenizeParams | None = None, *, direct: bool = False
    ) -> Result: ...


class WorkItemRunner:
    def __init__(self, operations: SupportsOperations) -> None:
        self.operations = operations

    async def run_work_items(self, items: list[WorkItem], *, priority: str = INTERACTIVE) -> list[WorkResult]:
        """Execute NATS work items at once; one WorkResult per item, in order.

        The sidecar hands over one group (equal :attr:`WorkItem.group_key`); a batch mixing groups
        runs as one call per group. ``priority``: the class the batch came in (an interactive one
        may run inside a running bulk forward, worker/batching/preemption.py)."""
        groups: dict[str, list[int]] = {}
        for i, wi in enumerate(items):
            groups.setdefault(wi.group_key, []).append(i)
        results: list[WorkResult | None] = [None] * len(items)
        await asyncio.gather(
            *(self._run_group([items[i] for i in idx], idx, results, priority) for idx in groups.values())
        )
        return [r for r in results if r is not None]

    async def _run_group(
        self, group: list[WorkItem], idx: list[int], results: list[WorkResult | None], priority: str
    ) -> None:
        first = group[0]
        spec = first.model_spec
        options = dict(first.options or {})
        if first.is_query:
            options["is_query"] = True
        started = time.time()
        tokens: list[int | None]
        try:
            # the work item's fields as the request's typed params, unchecked: protocol.params checks
            # them in the operation, as it checks a request of sie serve
            if first.operation == "encode":
                params = EncodeParams.model_construct(
                    output_types=first.output_types,
                    output_dtype=first.output_dtype,
                    instruction=first.instruction,
                    options=options,
                )
                res = await self.operations.encode(
                    spec, _items(group), params, direct=True, priority=priority
                )
                payloads = [packb(item) for item in res.items]
                tokens = [*res.item_tokens] if res.item_tokens else [None] * len(group)
            elif first.operation == "score":
                # one work item carries a whole score request; run each on its own
                for wi, i in zip(group, idx, strict=True):
                    query = parse_item(wi.query_item or {}, "query")
                    docs = [parse_item(d, "items", k) for k, d in enumerate(wi.score_items or [])]
                    score_params = ScoreParams.model_construct(instruction=wi.instruction, options=options)
                    res = await self.operations.score(
                        spec, query, docs, score_params, direct=True, priority=priority
                    )
                    body: dict[str, Any] = {"scores": res.items}
                    if res.query_id is not None:
                        body["query_id"] = res.query_id
                    results[i] = self._work_result(
                        wi, True, packb(body), res.timing, started, res.input_tokens, res.items
                    )
                return
            elif first.operation == "extract":
                extract_params = ExtractParams.model_construct(
                    labels=first.labels,
                    output_schema=first.output_schema,
                    instruction=first.instruction,
                    options=options,
                )
                res = await self.operations.extract(
                    spec, _items(group, named=True), extract_params, direct=True, priority=priority
                )
                payloads = [packb(item) for item in res.items]
                tokens = [*res.item_tokens] if res.item_tokens else [None] * len(group)
            elif first.operation == "tokenize":
                tokenize_params = TokenizeParams.model_construct(options=options)
                res = await self.operations.tokenize(spec, _items(group), tokenize_params, direct=True)
                payloads = [packb(item) for item in res.items]
                tokens = [item["count"] for item in res.items]
            else:
                raise invalid_input(f"unknown operation {first.operation!r}")
        except SIEError as exc:
            for wi, i in zip(group, idx, strict=True):
                results[i] = self._error_result(wi, exc)
            return
        except Exception as exc:
            log.exception("work items for %s failed", spec)
            err = SIEError(ErrorCode.INFERENCE_ERROR, f"internal error: {exc}")
            for wi, i in zip(group, idx, strict=True):
                results[i] = self._error_result(wi, err)
            return
        for wi, i, payload, tok, entry in zip(group, idx, payloads, tokens, res.items, strict=True):
            results[i] = self._work_result(wi, True, payload, res.timing, started, tok, [entry])

    def _work_result(
        self,
        wi: WorkItem,
        ok: bool,
        payload: bytes,
        timing: Timing,
        started: float,
        tokens: int | None,
        entries: list[Any],
    ) -> WorkResult:
        truncated_items, dropped_tokens = truncation_totals(entries)
        return WorkResult(
            work_item_id=wi.work_item_id,
            request_id=wi.request_id,
            item_index=wi.item_index,
            success=ok,
            result_msgpack=payload,
            inference_ms=timing.inference_ms,
            queue_ms=max(0.0, (started - wi.timestamp) * 1000) + timing.queue_ms,
            tokenization_ms=timing.tokenization_ms,
            postprocessing_ms=timing.postprocessing_ms,
            processing_ms=timing.total_ms,
            input_tokens=tokens,
            truncated_items=truncated_items,
            dropped_tokens=dropped_tokens,
        )

    @staticmethod
    def _error_result(wi: WorkItem, exc: SIEError) -> WorkResult:
        return WorkResult.failure(wi, exc.code, exc.message, retry_after_s=exc.retry_after, extra=exc.extra)


def _items(group: list[WorkItem], *, named: bool = False) -> list[Item]:
    """The group's items (one per work item), typed; a malformed one is 400 INVALID_INPUT. With
    ``named``, an item without an ``id`` gets the contract's default, ``item-<index>`` of its place
    in its own request (a group can hold items of several requests)."""
    items = [parse_item(wi.item or {}, "items", k) for k, wi in enumerate(group)]
    if named:
        for item, wi in zip(items, group, strict=True):
            if item.id is None:
                item.id = f"item-{wi.item_index}"
    return items
