"""Work item encoding and the group key that decides which items may share a batch."""

from __future__ import annotations

import orjson
import pytest

from protocol.codec import packb, unpackb
from protocol.work import (
    H_ITEMS,
    MSG_ID,
    RoutingHeader,
    WorkItem,
    WorkResult,
    chunk_plan,
    encode_own,
    encode_shared,
    item_cost,
    merged_item,
    pack_items,
    pack_results,
    results_chunks,
    shared_fields,
    unpack_items,
    unpack_results,
    work_items_of,
)


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
    wi = item(
        deadline=12.5,
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        batch_key="k",
        item={"text": "a" * 40},
    )
    route = RoutingHeader.of(wi)
    headers = route.headers()
    assert all(isinstance(v, str) for v in headers.values())
    # two headers: nats-py writes and parses each in Python
    assert sorted(headers) == ["Nats-Msg-Id", "Sie-Route"]
    assert headers["Nats-Msg-Id"] == "r.0"  # a publish sent again lands once
    back = RoutingHeader.from_headers(headers)
    assert back == route
    assert (back.work_item_id, back.request_id, back.item_index) == ("r.0", "r", 0)
    assert back.reply_subject == "_INBOX.g.r" and back.model_spec == wi.model_spec
    assert back.group_key == "k" and back.cost == item_cost("encode", {"text": "a" * 40})
    assert (back.timestamp, back.deadline, back.traceparent) == (1.0, 12.5, wi.traceparent)
    # what may be unset comes back unset
    bare = RoutingHeader.from_headers(RoutingHeader.of(item()).headers())
    assert (bare.deadline, bare.traceparent, bare.request_items) == (None, None, 1)
    # the count of the request's published items, for the sidecar to keep them in one batch
    several = RoutingHeader.of(wi, 3)
    assert RoutingHeader.from_headers(several.headers()).request_items == 3
    # the gateway's path, without the header object, writes the same headers
    assert (
        RoutingHeader.headers_of(wi, 3, "_INBOX.g.results")
        == RoutingHeader.of(wi, 3, "_INBOX.g.results").headers()
    )
    assert RoutingHeader.headers_of(item()) == RoutingHeader.of(item()).headers()


def test_the_routing_header_survives_any_text_in_its_strings():
    """Model ids and request ids travel inside a header value: quotes, separators, non-ASCII and
    line breaks must neither break the header block nor come back changed."""
    odd = 'org/mödel "x", [y]\r\nNats-Msg-Id: forged'
    route = RoutingHeader.of(item(model_id=odd))
    headers = route.headers()
    assert "\n" not in headers["Sie-Route"] and "\r" not in headers["Sie-Route"]
    assert RoutingHeader.from_headers(headers) == route


@pytest.mark.parametrize(
    "broken",
    [
        None,
        {},
        "no-route",
        "no-msg-id",
        "not-json",
        "not-array",
        "short",
        "bad-index",
        "bool-index",
        "null-reply",
        "empty-reply",
        "zero-cost",
    ],
)
def test_a_missing_or_malformed_routing_header_is_refused(broken):
    headers = RoutingHeader.of(item()).headers()
    fields = orjson.loads(headers["Sie-Route"])
    edits = {
        "bad-index": (1, "one"),
        "bool-index": (1, True),
        "null-reply": (2, None),
        "empty-reply": (2, ""),
        "zero-cost": (6, 0),
    }
    if broken == "no-route":
        del headers["Sie-Route"]
    elif broken == "no-msg-id":
        del headers["Nats-Msg-Id"]
    elif broken == "not-json":
        headers["Sie-Route"] = "[1, 2"
    elif broken == "not-array":
        headers["Sie-Route"] = '{"request_id": "r"}'
    elif broken == "short":
        headers["Sie-Route"] = orjson.dumps(fields[:-1]).decode()
    elif isinstance(broken, str):
        pos, value = edits[broken]
        fields[pos] = value
        headers["Sie-Route"] = orjson.dumps(fields).decode()
    else:
        headers = broken
    with pytest.raises(ValueError):
        RoutingHeader.from_headers(headers)


def test_several_results_travel_in_one_message_and_come_back_as_they_were():
    results = [WorkResult(work_item_id=f"r.{i}", request_id="r", item_index=i, success=True,
                          result_msgpack=bytes([i]) * 10) for i in range(3)]  # fmt: skip
    assert unpack_results(pack_results([r.to_msgpack() for r in results])) == results
    for bad in (packb({"a": 1}), packb([1, 2]), b"\xc1"):
        with pytest.raises(ValueError):
            unpack_results(bad)


def test_results_are_cut_into_messages_within_the_payload_limit():
    assert results_chunks([], 100) == []
    assert results_chunks([10, 10, 10], 1000) == [[0, 1, 2]]
    # 5 bytes of array head, each result its size and 5 of bin head
    assert results_chunks([40, 40, 40], 5 + 45 + 45) == [[0, 1], [2]]
    # one too big for any message still goes, alone (the publish then answers for it)
    assert results_chunks([10, 500, 10], 100) == [[0], [1], [2]]
    sizes = [30, 70, 5, 90, 1, 1, 1]
    for chunk in results_chunks(sizes, 120):
        assert len(chunk) == 1 or 5 + sum(sizes[i] + 5 for i in chunk) <= 120
    assert [i for c in results_chunks(sizes, 120) for i in c] == list(range(len(sizes)))


def chunk(n: int) -> list[WorkItem]:
    return [item(work_item_id=f"r.{i}", item_index=i, item={"text": "x" * 8 * i}) for i in range(n)]


def test_a_chunk_carries_each_item_with_its_own_index_cost_and_body():
    items = chunk(3)
    headers = RoutingHeader.chunk_headers(items, 5, "_INBOX.g.results")
    routes = RoutingHeader.items_of(headers)
    assert [r.work_item_id for r in routes] == ["r.0", "r.1", "r.2"]
    assert [r.item_index for r in routes] == [0, 1, 2]
    assert [r.cost for r in routes] == [item_cost("encode", it.item) for it in items] == [2, 4, 6]
    assert {(r.request_id, r.request_items, r.results_subject, r.group_key) for r in routes} == {
        ("r", 5, "_INBOX.g.results", items[0].group_key)
    }
    assert headers[MSG_ID] == "r.0+3"  # one message id per chunk: a publish sent again lands once
    body = pack_items([it.to_msgpack() for it in items])
    shared, own = unpack_items(body, 3)
    assert shared is None and [WorkItem.from_msgpack(b) for b in own] == items
    assert work_items_of(body) == items
    assert work_items_of(items[1].to_msgpack()) == [items[1]]  # a message of one item
    assert RoutingHeader.items_of(RoutingHeader.headers_of(items[1])) == [RoutingHeader.of(items[1])]


def test_a_chunk_of_the_shared_form_carries_the_shared_fields_once():
    items = chunk(3)
    for it in items:
        it.batch_key = it.group_key
        it.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    whole = pack_items([it.to_msgpack() for it in items])
    body = pack_items([encode_own(it) for it in items], encode_shared(items[0]))
    assert len(body) < len(whole) * 0.6  # what the items share is most of each
    shared, own = unpack_items(body, 3)
    assert shared is not None and [unpackb(b) for b in own] == [
        {"item_index": i, "item": it.item} for i, it in enumerate(items)
    ]
    assert [merged_item(shared_fields(shared), b) for b in own] == items  # ids follow from index
    assert work_items_of(body) == items
    with pytest.raises(ValueError):  # an entry that is not an item's own fields
        merged_item(shared_fields(shared), packb(["not", "a", "map"]))
    with pytest.raises(ValueError):  # nor one without its index
        merged_item(shared_fields(shared), packb({"item": {"text": "x"}}))
    with pytest.raises(ValueError, match="lack"):  # shared fields without what every item needs
        shared_fields(packb({"request_id": "r", "operation": "encode"}))
    for bad in (packb([1]), packb({**unpackb(encode_shared(items[0])), "request_id": 7})):
        with pytest.raises(ValueError):
            shared_fields(bad)
    # an entry's unknown fields are ignored, like every map's in protocol
    assert (
        merged_item(shared_fields(shared), packb({"item_index": 1, "item": items[1].item, "new": 1}))
        == items[1]
    )


@pytest.mark.parametrize(
    "entries",
    [
        "not json",
        "{}",
        "[]",
        "[[0, 1], [0, 2]]",
        "[[0]]",
        "[[-1, 1]]",
        "[[0, 0]]",
        "[[0, true]]",
        '[["0", 1]]',
    ],
)
def test_a_malformed_chunk_header_is_refused(entries):
    headers = {**RoutingHeader.chunk_headers(chunk(2)), H_ITEMS: entries}
    with pytest.raises(ValueError):
        RoutingHeader.items_of(headers)


def test_a_chunk_body_that_does_not_match_its_header_is_refused():
    body = pack_items([it.to_msgpack() for it in chunk(2)])
    shared_form = pack_items([b"own"], b"shared")
    cases = (
        (body, 3),
        (packb(["a", "b"]), 2),
        (packb({"a": 1}), 1),
        (b"\xc1", 1),
        (shared_form, 2),  # the shared form with fewer entries than its header names
        (packb({"shared": "not bytes", "items": [b"own"]}), 1),
        (packb({"shared": b"s", "items": "not a list"}), 1),
    )
    for data, count in cases:
        with pytest.raises(ValueError):
            unpack_items(data, count)


def test_chunks_keep_within_the_item_count_and_the_payload_limit():
    assert chunk_plan([10] * 5, 2, 1000) == [[0, 1], [2, 3], [4]]
    assert chunk_plan([10] * 5, 32, 1000) == [[0, 1, 2, 3, 4]]
    # bodies over the limit together are cut; one over it alone travels alone
    assert chunk_plan([400, 400, 400, 5000, 10], 32, 1000) == [[0, 1], [2], [3], [4]]
    assert chunk_plan([], 32, 1000) == []
