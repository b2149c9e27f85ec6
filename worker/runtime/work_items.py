"""The sidecar path: job items in (protocol.jobs, decoded by protocol.work_codec), one WorkResult per
item out. Their params were checked at the front door; the operations check only the model's limits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from protocol.api import Item, truncation_totals
from protocol.catalog import Resolved
from protocol.codec import packb
from protocol.errors import ErrorCode, SIEError
from protocol.jobs import EncodeJob, ExtractJob, Job, JobItem, ScoreInput, ScoreJob, TokenizeJob
from protocol.params import EncodeOptions, ExtractOptions, ScoreOptions, TokenizeOptions
from protocol.priority import INTERACTIVE
from protocol.work import WorkResult
from worker.runtime.results import Result, Timing

log = logging.getLogger("worker.runtime")


class SupportsOperations(Protocol):
    """What runs the job items (:class:`worker.runtime.operations.Operations`)."""

    def resolve(self, spec: str) -> Resolved: ...

    async def run_encode(
        self,
        resolved: Resolved,
        opts: EncodeOptions,
        items: Sequence[Item],
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def run_score(
        self,
        resolved: Resolved,
        opts: ScoreOptions,
        query: Item,
        items: Sequence[Item],
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def run_extract(
        self,
        resolved: Resolved,
        opts: ExtractOptions,
        items: Sequence[Item],
        *,
        direct: bool = False,
        priority: str = INTERACTIVE,
    ) -> Result: ...

    async def run_tokenize(
        self, resolved: Resolved, opts: TokenizeOptions, items: Sequence[Item]
    ) -> Result: ...


class WorkItemRunner:
    def __init__(self, operations: SupportsOperations) -> None:
        self.operations = operations

    async def run_work_items(self, items: list[JobItem], *, priority: str = INTERACTIVE) -> list[WorkResult]:
        """Run job items at once; one WorkResult per item, in order.

        The sidecar hands over one group (equal :attr:`Job.batch_key`); a batch mixing groups runs
        as one call per group. ``priority``: the class the batch came in (an interactive one may run
        inside a running bulk forward, worker/batching/preemption.py)."""
        groups: dict[str, list[int]] = {}
        firsts: dict[str, Job] = {}  # the job whose params each group runs with
        keys: dict[int, str] = {}  # each job's group, found once per job (one per message)
        for i, it in enumerate(items):
            job = it.job
            key = keys.get(id(job))
            if key is None:
                key = job.batch_key
                first = firsts.setdefault(key, job)
                if first is not job and (
                    first.content() != job.content() or first.model_spec != job.model_spec
                ):
                    key = f"{key}/{id(job)}"  # a key that does not say what it runs: a group of its own
                    firsts[key] = job
                keys[id(job)] = key
            groups.setdefault(key, []).append(i)
        results: list[WorkResult | None] = [None] * len(items)
        await asyncio.gather(
            *(self._run_group([items[i] for i in idx], idx, results, priority) for idx in groups.values())
        )
        return [r for r in results if r is not None]

    async def _run_group(
        self, group: list[JobItem], idx: list[int], results: list[WorkResult | None], priority: str
    ) -> None:
        job = group[0].job
        ops = self.operations
        started = time.time()
        tokens: list[int | None]
        try:
            resolved = ops.resolve(job.model_spec)
            if isinstance(job, ScoreJob):
                # one job item carries a whole score request; each runs on its own
                for it, i in zip(group, idx, strict=True):
                    pair = it.input
                    if not isinstance(pair, ScoreInput):
                        raise TypeError("a score job's input is not a ScoreInput")
                    res = await ops.run_score(
                        resolved, job.params, pair.query, pair.items, direct=True, priority=priority
                    )
                    body: dict[str, Any] = {"scores": res.items}
                    if res.query_id is not None:
                        body["query_id"] = res.query_id
                    results[i] = self._work_result(
                        it, packb(body), res.timing, started, res.input_tokens, res.items
                    )
                return
            inputs = [it.item for it in group]
            if isinstance(job, EncodeJob):
                res = await ops.run_encode(resolved, job.params, inputs, direct=True, priority=priority)
                tokens = [*res.item_tokens] if res.item_tokens else [None] * len(group)
            elif isinstance(job, ExtractJob):
                for it, item in zip(group, inputs, strict=True):
                    if item.id is None:  # the contract's default: its place in its own request
                        item.id = f"item-{it.index}"
                res = await ops.run_extract(resolved, job.params, inputs, direct=True, priority=priority)
                tokens = [*res.item_tokens] if res.item_tokens else [None] * len(group)
            elif isinstance(job, TokenizeJob):
                res = await ops.run_tokenize(resolved, job.params, inputs)
                tokens = [item["count"] for item in res.items]
            else:
                raise TypeError(f"no runner for {type(job).__name__}")
        except SIEError as exc:
            for it, i in zip(group, idx, strict=True):
                results[i] = self._error_result(it, exc)
            return
        except Exception as exc:
            log.exception("job items for %s failed", job.model_spec)
            err = SIEError(ErrorCode.INFERENCE_ERROR, f"internal error: {exc}")
            for it, i in zip(group, idx, strict=True):
                results[i] = self._error_result(it, err)
            return
        for it, i, entry, tok in zip(group, idx, res.items, tokens, strict=True):
            results[i] = self._work_result(it, packb(entry), res.timing, started, tok, [entry])

    @staticmethod
    def _work_result(
        it: JobItem, payload: bytes, timing: Timing, started: float, tokens: int | None, entries: list[Any]
    ) -> WorkResult:
        truncated_items, dropped_tokens = truncation_totals(entries)
        return WorkResult(
            work_item_id=it.work_item_id,
            request_id=it.request_id,
            item_index=it.index,
            success=True,
            result_msgpack=payload,
            inference_ms=timing.inference_ms,
            queue_ms=max(0.0, (started - it.job.timestamp) * 1000) + timing.queue_ms,
            tokenization_ms=timing.tokenization_ms,
            postprocessing_ms=timing.postprocessing_ms,
            processing_ms=timing.total_ms,
            input_tokens=tokens,
            truncated_items=truncated_items,
            dropped_tokens=dropped_tokens,
        )

    @staticmethod
    def _error_result(it: JobItem, exc: SIEError) -> WorkResult:
        return WorkResult.failure(it, exc.code, exc.message, retry_after_s=exc.retry_after, extra=exc.extra)
