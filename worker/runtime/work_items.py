"""The sidecar path: NATS work items in, one WorkResult per item out."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from protocol.api import truncation_totals
from protocol.codec import packb
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.priority import INTERACTIVE
from protocol.work import WorkItem, WorkResult
from worker.runtime.results import Result, Timing

log = logging.getLogger("worker.runtime")


class Operations(Protocol):
    """What runs the work items (:class:`worker.runtime.operations.Operations`)."""

    async def encode(
        self,
        spec: str,
        items: list[dict[str, Any]],
        params: dict[str, Any] | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def score(
        self,
        spec: str,
        query: dict[str, Any],
        items: list[dict[str, Any]],
        instruction: Any = None,
        options: dict[str, Any] | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def extract(
        self,
        spec: str,
        items: list[dict[str, Any]],
        params: dict[str, Any] | None = None,
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def tokenize(
        self,
        spec: str,
        items: list[dict[str, Any]],
        options: dict[str, Any] | None = None,
        *,
        direct: bool = False,
    ) -> Result: ...


class WorkItemRunner:
    def __init__(self, operations: Operations) -> None:
        self.operations = operations

    async def run_work_items(self, items: list[WorkItem]) -> list[WorkResult]:
        """Execute NATS work items at once; one WorkResult per item, in order.

        The sidecar hands over one group (equal :attr:`WorkItem.group_key`); a batch mixing groups
        runs as one call per group."""
        groups: dict[str, list[int]] = {}
        for i, wi in enumerate(items):
            groups.setdefault(wi.group_key, []).append(i)
        results: list[WorkResult | None] = [None] * len(items)
        await asyncio.gather(
            *(self._run_group([items[i] for i in idx], idx, results) for idx in groups.values())
        )
        return [r for r in results if r is not None]

    async def _run_group(
        self, group: list[WorkItem], idx: list[int], results: list[WorkResult | None]
    ) -> None:
        first = group[0]
        spec = first.model_spec
        options = dict(first.options or {})
        if first.is_query:
            options["is_query"] = True
        started = time.time()
        tokens: list[int | None]
        try:
            if first.operation == "encode":
                params = {
                    "output_types": first.output_types,
                    "output_dtype": first.output_dtype,
                    "instruction": first.instruction,
                    "options": options,
                }
                res = await self.operations.encode(spec, [wi.item or {} for wi in group], params, direct=True)
                payloads = [packb(item) for item in res.items]
                tokens = [*res.item_tokens] if res.item_tokens else [None] * len(group)
            elif first.operation == "score":
                # one work item carries a whole score request; run each on its own
                for wi, i in zip(group, idx, strict=True):
                    res = await self.operations.score(
                        spec, wi.query_item or {}, wi.score_items or [], wi.instruction, options, direct=True
                    )
                    body: dict[str, Any] = {"scores": res.items}
                    if res.query_id is not None:
                        body["query_id"] = res.query_id
                    results[i] = self._work_result(
                        wi, True, packb(body), res.timing, started, res.input_tokens, res.items
                    )
                return
            elif first.operation == "extract":
                params = {
                    "labels": first.labels,
                    "output_schema": first.output_schema,
                    "instruction": first.instruction,
                    "options": options,
                }
                res = await self.operations.extract(
                    spec, [wi.item or {} for wi in group], params, direct=True
                )
                payloads = [packb(item) for item in res.items]
                tokens = [*res.item_tokens] if res.item_tokens else [None] * len(group)
            elif first.operation == "tokenize":
                res = await self.operations.tokenize(
                    spec, [wi.item or {} for wi in group], options, direct=True
                )
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
