"""Work item encoding and the group key that decides which items may share a batch."""

from __future__ import annotations

import pytest

from protocol.codec import unpackb
from protocol.work import RoutingHeader, WorkItem, WorkResult, item_cost


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


def test_the_routing_header_carries_what_the_sidecar_needs_without_the_body():
    wi = item(deadline=12.5, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01", batch_key="k",
              item={"text": "a" * 40})
    route = RoutingHeader.of(wi)
    headers = route.headers()
    assert all(isinstance(v, str) for v in headers.values())
    assert headers["Nats-Msg-Id"] == "r.0"  # a publish sent again lands once
    back = RoutingHeader.from_headers(headers)
    assert back == route
    assert (back.work_item_id, back.request_id, back.item_index) == ("r.0", "r", 0)
    assert back.reply_subject == "_INBOX.g.r" and back.model_spec == wi.model_spec
    assert back.group_key == "k" and back.cost == item_cost("encode", {"text": "a" * 40})
    assert (back.timestamp, back.deadline, back.traceparent) == (1.0, 12.5, wi.traceparent)
    # what may be unset is left out
    bare = RoutingHeader.of(item()).headers()
    assert "Sie-Deadline" not in bare and "traceparent" not in bare and "Sie-Items" not in bare
    assert RoutingHeader.from_headers(bare).request_items == 1
    # the count of the request's published items, for the sidecar to keep them in one batch
    several = RoutingHeader.of(wi, 3)
    assert several.headers()["Sie-Items"] == "3" and RoutingHeader.from_headers(several.headers()) == several


@pytest.mark.parametrize("broken", [None, {}, "missing", "bad-index", "empty-reply"])
def test_a_missing_or_malformed_routing_header_is_refused(broken):
    headers = RoutingHeader.of(item()).headers()
    if broken == "missing":
        del headers["Sie-Model"]
    elif broken == "bad-index":
        headers["Sie-Index"] = "one"
    elif broken == "empty-reply":
        headers["Sie-Reply"] = ""
    else:
        headers = broken
    with pytest.raises(ValueError):
        RoutingHeader.from_headers(headers)
