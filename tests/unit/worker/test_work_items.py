"""WorkItemRunner alone: job items in, one WorkResult per item out, over Operations."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from protocol.api import Item
from protocol.catalog import Catalog
from protocol.codec import unpackb
from protocol.errors import ErrorCode
from protocol.jobs import ExtractJob, Job, JobItem, ScoreInput
from protocol.params import ExtractOptions
from tests.support.jobs import encode_job, encode_params, route, score_job
from tests.support.worker_parts import TASKS, Models, fake_config, settings
from worker.metrics import WorkerMetrics
from worker.runtime.chunking import Chunker
from worker.runtime.executor import Executor
from worker.runtime.operations import Operations
from worker.runtime.work_items import WorkItemRunner


def work_item(i: int, item: Item | None = None, *, request_id: str = "r", job: Job | None = None) -> JobItem:
    job = job or encode_job(request_id, timestamp=0.0)
    return JobItem(job, i, item or Item(text=f"text {i}"))


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
    sparse = encode_job("r", timestamp=0.0, params=encode_params(output_types=("sparse",)))
    items = [work_item(0, Item(id="a", text="one")), work_item(1, job=sparse), work_item(2, Item(text="two"))]
    results = await runner.run_work_items(items)
    assert [r.work_item_id for r in results] == ["r.0", "r.1", "r.2"] and all(r.success for r in results)
    first, sparse_out, third = (unpackb(r.result_msgpack) for r in results)
    assert first["id"] == "a" and "dense" in first and "sparse" in sparse_out and "dense" in third
    assert results[0].input_tokens == 3 and results[0].queue_ms > 0  # the job was built at time 0


async def test_a_score_item_carries_its_whole_request(runner):
    pair = ScoreInput(Item(id="q", text="pie"), (Item(text="pie"),))
    (result,) = await runner.run_work_items([JobItem(score_job("r"), 0, pair)])
    body = unpackb(result.result_msgpack)
    assert body["query_id"] == "q" and [e["item_id"] for e in body["scores"]] == ["item-0"]


async def test_what_the_model_refuses_fails_every_item_of_its_group_only(runner):
    pictures = encode_job("p", timestamp=0.0, params=encode_params(output_dtype="int8"))  # another group
    bad = [work_item(0, Item(images=[b"png"]), job=pictures), work_item(1, job=pictures)]
    results = await runner.run_work_items([*bad, work_item(2)])
    assert [r.success for r in results] == [False, False, True]
    assert results[0].error_code == ErrorCode.INVALID_INPUT and "images" in results[0].error


async def test_a_job_that_claims_anothers_batch_key_runs_with_its_own_params(runner):
    plain = encode_job("r", timestamp=0.0)
    sparse = encode_job(
        "s", timestamp=0.0, params=encode_params(output_types=("sparse",)), batch_key=plain.batch_key
    )
    results = await runner.run_work_items([work_item(0, job=plain), work_item(0, job=sparse)])
    dense_out, sparse_out = (unpackb(r.result_msgpack) for r in results)
    assert "dense" in dense_out and "sparse" in sparse_out and "dense" not in sparse_out


class Broken:
    """Operations with a bug: every call raises."""

    def resolve(self, spec):
        return None

    async def run_encode(self, *args, **kwargs):
        raise RuntimeError("boom")

    run_score = run_extract = run_tokenize = run_encode


async def test_a_bug_is_an_inference_error_for_the_group():
    results = await WorkItemRunner(Broken()).run_work_items([work_item(0), work_item(1)])
    assert {r.error_code for r in results} == {ErrorCode.INFERENCE_ERROR}
    assert results[0].error == "internal error: boom"


def extract_job(request_id: str) -> ExtractJob:
    params = ExtractOptions(options={}, labels=(), output_schema=None, instruction=None, lora=None, max_length=None,
                            truncate=True)  # fmt: skip
    return ExtractJob(**route(request_id, 3), params=params)


async def test_an_extract_item_without_an_id_is_named_by_its_place_in_its_request(runner):
    # one forward group holding items of two requests: each default id is the item's position in
    # its own request (the contract's item-<index>), not its place in the group
    r, s = extract_job("r"), extract_job("s")
    group = [work_item(2, job=r), work_item(0, job=s), work_item(1, Item(id="mine", text="x"), job=s)]
    results = await runner.run_work_items(group)
    assert [unpackb(r.result_msgpack)["id"] for r in results] == ["item-2", "item-0", "mine"]
