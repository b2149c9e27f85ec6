"""Operations alone: typed requests over fake models that a one-method ModelSource hands over."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from protocol.api import EncodeParams, ExtractParams, Item, ScoreParams, TokenizeParams
from protocol.catalog import Catalog
from protocol.errors import ErrorCode, SIEError
from tests.support.worker_parts import TASKS, Models, fake_config, settings
from worker.metrics import WorkerMetrics
from worker.runtime.chunking import Chunker
from worker.runtime.executor import Executor
from worker.runtime.operations import Operations


@pytest.fixture
async def make():
    made: list[tuple[Models, ThreadPoolExecutor]] = []

    def build(models: Models | None = None, **kw) -> Operations:
        models = models or Models()
        pool = ThreadPoolExecutor(2)
        executor = Executor(pool, max_padding_share=0.2)
        catalog = Catalog([fake_config("m", tasks=TASKS), fake_config("embed-only")])
        made.append((models, pool))
        return Operations(
            settings(**kw),
            catalog,
            models=models,
            executor=executor,
            chunker=Chunker(executor, max_chunks_per_item=4),
            metrics=WorkerMetrics(),
        )

    yield build
    for models, pool in made:
        for lm in models.loaded.values():
            await lm.former.close()
        pool.shutdown()


async def test_encode_answers_each_item_with_its_id_and_asked_outputs(make):
    ops = make()
    items = [Item(id="a", text="hello world"), Item(text="second")]
    res = await ops.encode(
        "m", items, EncodeParams(output_types=["sparse"], output_dtype="float16"), direct=True
    )
    assert [item.get("id") for item in res.items] == ["a", None]
    assert set(res.items[0]) == {"id", "sparse"} and res.items[0]["sparse"]["dtype"] == "float16"
    assert res.item_tokens == [4, 3] and res.input_tokens == 7
    plain = await ops.encode("m", items)  # through the batcher, the default params
    assert plain.items[0]["dense"]["values"].dtype == np.float32


async def test_score_ranks_the_items_and_names_the_query(make):
    ops = make()
    query = Item(id="q", text="apple pie")
    docs = [Item(text="pie"), Item(id="best", text="apple pie"), Item(text="car")]
    res = await ops.score("m", query, docs, ScoreParams(), direct=True)
    assert res.query_id == "q"
    assert [e["item_id"] for e in res.items][0] == "best" and [e["rank"] for e in res.items] == [0, 1, 2]


async def test_score_limits_its_items(make):
    ops = make(max_score_items=2)
    for docs, message in (([], "must not be empty"), ([Item(text="x")] * 3, "At most 2 items")):
        with pytest.raises(SIEError) as err:
            await ops.score("m", Item(text="q"), docs, direct=True)
        assert err.value.code == ErrorCode.INVALID_INPUT and message in err.value.message


async def test_items_are_checked_against_the_model_with_the_query_first(make):
    ops = make(max_item_text_bytes=10)
    with pytest.raises(SIEError) as err:
        await ops.score("m", Item(text="q"), [Item(text="fine"), Item(id="x")], direct=True)
    assert err.value.message == "Item 2 has no text" and err.value.param == "items.2.text"
    with pytest.raises(SIEError) as err:
        await ops.encode("m", [Item(text="x" * 11)], direct=True)
    assert err.value.message == "Item 0: text is larger than 10 bytes"
    with pytest.raises(SIEError) as err:
        await ops.encode("m", [Item(text="x", images=[b"png"])], direct=True)
    assert err.value.message == "Model 'm' does not accept images input"


async def test_extract_answers_every_item_under_an_id(make):
    ops = make()
    res = await ops.extract(
        "m", [Item(text="Ada Lovelace"), Item(id="b", text="none")], ExtractParams(labels=["person"])
    )
    assert [item["id"] for item in res.items] == ["item-0", "b"]
    assert [e["label"] for e in res.items[0]["entities"]] == ["person", "person"]


async def test_the_requests_options_are_checked_by_protocol_params(make):
    ops = make()
    cases = [
        (ops.encode("m", [Item(text="x")], EncodeParams(output_types=["multivector"])), "output_types"),
        (
            ops.encode("m", [Item(text="x")], EncodeParams(options={"overflow_policy": "x"})),
            "overflow_policy",
        ),
        (ops.extract("embed-only", [Item(text="x")]), "model"),
        (ops.score("embed-only", Item(text="q"), [Item(text="x")]), "model"),
    ]
    for call, param in cases:
        with pytest.raises(SIEError) as err:
            await call
        assert err.value.code == ErrorCode.INVALID_INPUT and err.value.param == param


async def test_a_model_without_a_tokenizer_has_none_to_expose(make):
    with pytest.raises(SIEError) as err:
        await make().tokenize("m", [Item(text="x")], TokenizeParams())
    assert "has no tokenizer to expose" in err.value.message


async def test_what_the_model_source_answers_is_the_answer(make):
    loading = SIEError(ErrorCode.MODEL_LOADING, "Model 'm' is loading; retry shortly", retry_after=2)
    with pytest.raises(SIEError) as err:
        await make(Models(loading)).encode("m", [Item(text="x")], direct=True)
    assert err.value is loading


async def test_a_chunked_request_needs_a_text_tokenizer(make):
    with pytest.raises(SIEError) as err:
        await make().encode("m", [Item(text="x")], EncodeParams(options={"overflow_policy": "chunk"}))
    assert err.value.param == "overflow_policy" and "cannot chunk" in err.value.message
