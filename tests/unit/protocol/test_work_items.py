"""Work item encoding and the group key that decides which items may share a batch."""

from __future__ import annotations

from protocol.codec import unpackb
from protocol.work import WorkItem, WorkResult


def item(**extra) -> WorkItem:
    values = dict(
        work_item_id="r.0", request_id="r", item_index=0, total_items=1, operation="encode",
        model_id="m", profile_id="default", pool_name="default", machine_profile="cpu",
        router_id="g", reply_subject="_INBOX.g.r", timestamp=1.0, item={"text": "hi"},
        output_types=["dense"],
    )  # fmt: skip
    values.update(extra)
    return WorkItem(**values)


def test_group_keys():
    base = item().group_key
    assert item(work_item_id="s.3", request_id="s", item_index=3, item={"text": "other"}).group_key == base
    differing = [
        item(operation="extract"),
        item(model_id="m2"),
        item(profile_id="fast"),
        item(options={"lora": "adapter-a"}),
        item(options={"lora": "adapter-b"}),
        item(options={"output_dim": 64}),
        item(instruction="query: "),
        item(is_query=True),
        item(output_types=["sparse"]),
        item(output_dtype="int8"),
        item(labels=["person"]),
    ]
    keys = [base] + [it.group_key for it in differing]
    assert len(set(keys)) == len(keys)
    # a stamped key is taken as it is (the gateway derives it once per request)
    assert item(batch_key="k1").group_key == "k1"


def test_encoding_round_trips_and_leaves_out_unset_fields():
    wi = item(options={"nested": {"a": [1, 2]}}, batch_key="k")
    data = wi.to_msgpack()
    raw = unpackb(data)
    assert "query_item" not in raw and raw["options"] == {"nested": {"a": [1, 2]}}
    assert WorkItem.from_msgpack(data) == wi
    res = WorkResult.failure(wi, "INVALID_INPUT", "bad", extra={"k": [1]})
    assert WorkResult.from_msgpack(res.to_msgpack()) == res
