"""gateway.same_items alone: which items of a request are the same work, and whose answer an item gets."""

from __future__ import annotations

from gateway.same_items import COPY, answer_for, duplicates
from protocol.api import Item
from protocol.codec import packb, unpackb
from protocol.jobs import ExtractJob, JobItem, ScoreInput
from protocol.params import ExtractOptions
from protocol.work import WorkResult
from tests.support.jobs import encode_job, route, score_job

ENCODE = encode_job("r", 5)
EXTRACT = ExtractJob(
    **route("r", 5),
    params=ExtractOptions(options={}, labels=(), output_schema=None, instruction=None, lora=None,
                          max_length=None, truncate=True),
)  # fmt: skip


def item(i: int, operation: str = "encode", *, item: dict) -> JobItem:
    return JobItem(EXTRACT if operation == "extract" else ENCODE, i, Item(**item))


def test_equal_inputs_point_at_the_first_one_not_yet_answered():
    items = [
        item(0, item={"text": "a"}),
        item(1, item={"text": "a"}),
        item(2, item={"text": "a", "id": "x"}),  # an id of its own is echoed: other work
        item(3, item={"text": "b"}),
        item(4, item={"text": "a"}),
    ]
    assert duplicates(items, [None] * 5) == {1: 0, 4: 0}
    cached = WorkResult("r.0", "r", 0, True, b"\x80")
    assert duplicates(items, [cached, None, None, None, None]) == {4: 1}
    pair = ScoreInput(Item(text="q"), (Item(text="a"),))
    assert duplicates([JobItem(score_job(), 0, pair)] * 2, [None, None]) == {}  # a score job: one item
    assert COPY.item_index == -1 and not COPY.success


def test_an_answer_is_handed_over_under_the_items_own_index_and_name():
    made = WorkResult(
        "r.0", "r", 0, True, packb({"id": "item-0", "entities": [1]}), input_tokens=7, worker_id="w"
    )
    copied = answer_for(made, item(3, "extract", item={"text": "a"}))
    assert (copied.work_item_id, copied.item_index, copied.input_tokens, copied.worker_id) == (
        "r.3",
        3,
        7,
        "w",
    )
    assert unpackb(copied.result_msgpack) == {"id": "item-3", "entities": [1]}
    named = answer_for(made, item(3, "extract", item={"text": "a", "id": "mine"}))
    assert named.result_msgpack == made.result_msgpack  # its own id was in the answer already
    encoded = WorkResult("r.0", "r", 0, True, packb({"dense": [1.0]}))
    assert answer_for(encoded, item(2, item={"text": "a"})).result_msgpack == encoded.result_msgpack
    assert made.item_index == 0  # the original is left as it was
