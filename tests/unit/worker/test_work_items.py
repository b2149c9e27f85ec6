"""WorkItemRunner alone: NATS work items in, one WorkResult per item out, over Operations."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from protocol.catalog import Catalog
from protocol.codec import unpackb
from protocol.errors import ErrorCode
from protocol.work import WorkItem
from tests.support.worker_parts import TASKS, Models, fake_config, settings
from worker.metrics import WorkerMetrics
from worker.runtime.chunking import Chunker
from worker.runtime.executor import Executor
from worker.runtime.operations import Operations
from worker.runtime.work_items import WorkItemRunner


def work_item(i: int, operation: str = "encode", **fields) -> WorkItem:
    base = dict(
        work_item_id=f"r.{i}", request_id="r", item_index=i, total_items=1, operation=operation, model_id="m",
        profile_id="default", pool_name="default", machine_profile="cpu", router_id="g", reply_subject="_INBOX.r",
        timestamp=0.0, item={"text": f"text {i}"},
    )  # fmt: skip
    return WorkItem(**{**base, **fields})


@pytest.fixture
async def runner():
    models = Models()
    pool = ThreadPoolExecutor(2)
    executor = Executor(pool, max_padding_share=0.2)
    ops = Operations(
        settings(),
        Catalog([fake_config("m", tasks=TASKS)]),
        models=models,
        executor=executor,
        chunker=Chunker(executor, max_chunks_per_item=4),
        metrics=WorkerMetrics(),
    )
    yield WorkItemRunner(ops)
    for lm in models.loaded.values():
        await lm.former.close()
    pool.shutdown()


async def test_each_item_gets_its_own_result_in_order_across_groups(runner):
    items = [
        work_item(0, item={"id": "a", "text": "one"}),
        work_item(1, output_types=["sparse"]),
        work_item(2, item={"text": "two"}),
    ]
    results = await runner.run_work_items(items)
    assert [r.work_item_id for r in results] == ["r.0", "r.1", "r.2"] and all(r.success for r in results)
    first, sparse, third = (unpackb(r.result_msgpack) for r in results)
    assert first["id"] == "a" and "dense" in first and "sparse" in sparse and "dense" in third
    assert results[0].input_tokens == 3 and results[0].queue_ms > 0  # the item was built at time 0


async def test_a_score_item_carries_its_whole_request(runner):
    (result,) = await runner.run_work_items(
        [
            work_item(
                0, "score", item=None, query_item={"id": "q", "text": "pie"}, score_items=[{"text": "pie"}]
            )
        ]
    )
    body = unpackb(result.result_msgpack)
    assert body["query_id"] == "q" and [e["item_id"] for e in body["scores"]] == ["item-0"]


async def test_a_bad_request_fails_every_item_of_its_group_only(runner):
    bad = [work_item(0, output_dtype="int3"), work_item(1, output_dtype="int3")]
    results = await runner.run_work_items([*bad, work_item(2)])
    assert [r.success for r in results] == [False, False, True]
    assert results[0].error_code == ErrorCode.INVALID_INPUT and "output_dtype" in results[0].error


async def test_a_malformed_item_is_invalid_input_naming_its_field(runner):
    (result,) = await runner.run_work_items([work_item(0, item={"text": 5})])
    assert result.error_code == ErrorCode.INVALID_INPUT and result.error.startswith("Field 'items.0.text'")


async def test_an_unknown_operation_is_invalid_input(runner):
    (result,) = await runner.run_work_items([work_item(0, "summarise")])
    assert result.error_code == ErrorCode.INVALID_INPUT and "unknown operation" in result.error


class Broken:
    """Operations with a bug: every call raises."""

    async def encode(self, *args, **kwargs):
        raise RuntimeError("boom")

    score = extract = tokenize = encode


async def test_a_bug_is_an_inference_error_for_the_group():
    results = await WorkItemRunner(Broken()).run_work_items([work_item(0), work_item(1)])
    assert {r.error_code for r in results} == {ErrorCode.INFERENCE_ERROR}
    assert results[0].error == "internal error: boom"


async def test_an_extract_item_without_an_id_is_named_by_its_place_in_its_request(runner):
    # one forward group holding items of two requests: each default id is the item's position in
    # its own request (the contract's item-<index>), not its place in the group
    group = [
        work_item(2, "extract", request_id="r", work_item_id="r.2"),
        work_item(0, "extract", request_id="s", work_item_id="s.0"),
        work_item(1, "extract", request_id="s", work_item_id="s.1", item={"id": "mine", "text": "x"}),
    ]
    results = await runner.run_work_items(group)
    assert [unpackb(r.result_msgpack)["id"] for r in results] == ["item-2", "item-0", "mine"]
