"""The jobs and their one codec: job → work messages → RunBatch → job items, results → messages."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from protocol import ipc
from protocol.api import Item
from protocol.codec import packb, unpackb
from protocol.jobs import (
    EncodeJob,
    ExtractJob,
    ScoreInput,
    ScoreJob,
    TokenizeJob,
    input_cost,
    job_items,
    text_cost,
)
from protocol.params import (
    ChunkSpec,
    EncodeOptions,
    ExtractOptions,
    MuveraConfig,
    ScoreOptions,
    TokenizeOptions,
)
from protocol.work import WorkResult
from protocol.work_codec import (
    H_ITEMS,
    H_PAYLOAD,
    H_ROUTE,
    MSG_ID,
    WorkCodec,
    chunk_plan,
    decode_job,
    encode_job,
)

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ROUTE = dict(
    request_id="r", model_id="m", profile_id="default", pool_name="default", machine_profile="cpu",
    router_id="g", reply_subject="_INBOX.g.r", timestamp=1.0, total_items=3,
)  # fmt: skip


def encode_params(**change) -> EncodeOptions:
    base = EncodeOptions(
        options={"nested": {"a": [1, 2]}}, output_types=("dense",), output_dtype="float32", instruction=None,
        is_query=False, lora=None, max_length=None, truncate=True, normalize=True, output_dim=None,
        muvera=None, chunk=None,
    )  # fmt: skip
    return dataclasses.replace(base, **change)


def encode_job_(**change) -> EncodeJob:
    params = change.pop("params", encode_params())
    return EncodeJob(**{**ROUTE, **change}, params=params)


def jobs() -> list:
    return [
        encode_job_(deadline=12.5, traceparent=TRACE, bundle="default", bundle_config_hash="h"),
        encode_job_(
            params=encode_params(
                muvera=MuveraConfig(projection_dim=None),
                chunk=ChunkSpec(size=64),
                output_dim=8,
                instruction="q: ",
                is_query=True,
                lora="a",
            )
        ),  # fmt: skip
        ScoreJob(
            **ROUTE,
            params=ScoreOptions(
                options={}, instruction="i", lora=None, max_length=8, truncate=False, chunk=None
            ),
        ),  # fmt: skip
        ExtractJob(
            **ROUTE,
            params=ExtractOptions(
                options={},
                labels=("person",),
                output_schema={"t": "x"},
                instruction=None,
                lora=None,
                max_length=None,
                truncate=True,
            ),
        ),  # fmt: skip
        TokenizeJob(**ROUTE, params=TokenizeOptions(options={}, add_special_tokens=False)),
    ]


@pytest.mark.parametrize("job", jobs(), ids=lambda j: j.operation)
def test_a_job_round_trips_field_for_field(job):
    assert decode_job(encode_job(job)) == job
    assert decode_job(encode_job(job)).batch_key == job.batch_key


def test_the_batch_key_follows_what_decides_how_items_run():
    base = encode_job_().batch_key
    assert encode_job_(request_id="s", timestamp=9.0, reply_subject="_INBOX.g.s").batch_key == base
    differing = [
        encode_job_(model_id="m2"),
        encode_job_(profile_id="fast"),
        encode_job_(params=encode_params(lora="adapter-a")),
        encode_job_(params=encode_params(output_dim=64)),
        encode_job_(params=encode_params(instruction="query: ")),
        encode_job_(params=encode_params(is_query=True)),
        encode_job_(params=encode_params(output_types=("sparse",))),
        encode_job_(params=encode_params(output_dtype="int8")),
    ]
    keys = [base] + [j.batch_key for j in differing]
    assert len(set(keys)) == len(keys)


def messages(job, inputs, **kw):
    items = job_items(job, inputs)
    kw = {"per_message": 32, "max_bytes": 1 << 20, **kw}
    return items, WorkCodec.messages(items, **kw)


def through(msgs) -> tuple[list, list]:
    """What the sidecar and the worker make of ``msgs``: each item's route, then the job items."""
    routes, parts = [], []
    for m in msgs:
        rs = WorkCodec.routes(m.headers)
        shared, owns = WorkCodec.split(m.payload, len(rs))
        routes += rs
        parts += [(r.work_item_id, shared, own) for r, own in zip(rs, owns, strict=True)]
    request = WorkCodec.run_batch("m", parts, worker_id="w", priority="interactive")
    request = ipc.RunBatchRequest.from_map(unpackb(packb(request.to_map())))
    good, dead = WorkCodec.job_items(request)
    assert dead == []
    return routes, good


def test_items_travel_in_chunks_and_come_back_as_they_were():
    job = encode_job_(traceparent=TRACE, deadline=12.5)
    inputs = [Item(text="x" * 8 * i, id=f"i{i}") for i in range(5)]
    inputs[2] = Item(text="with media", images=[b"png", b"jpg"], metadata={"k": 1}, extra_key=[1])
    items, msgs = messages(job, inputs, per_message=2, results_subject="_INBOX.g.results")
    assert [m.slots for m in msgs] == [(0, 1), (2, 3), (4,)]
    assert [m.headers[MSG_ID] for m in msgs] == ["r.0+2", "r.2+2", "r.4"]  # a publish sent again lands once
    assert all(sorted(m.headers) == [MSG_ID, H_ITEMS, H_ROUTE] for m in msgs)
    routes, good = through(msgs)
    assert [r.work_item_id for r in routes] == [f"r.{i}" for i in range(5)]
    assert [r.cost for r in routes] == [input_cost(x) for x in inputs] == [2, 4, 6, 8, 10]
    assert {(r.request_id, r.reply_subject, r.model_spec, r.operation, r.group_key, r.traceparent,
             r.deadline, r.timestamp, r.results_subject) for r in routes} == {
        ("r", "_INBOX.g.r", "m", "encode", job.batch_key, TRACE, 12.5, 1.0, "_INBOX.g.results")
    }  # fmt: skip
    assert [r.request_items for r in routes] == [2, 2, 2, 2, 1]
    assert good == items
    assert good[2].item.model_extra == {"extra_key": [1]} and good[2].item.images == [b"png", b"jpg"]
    assert len({id(it.job) for it in good}) == 3  # each message's job decoded once


def test_the_job_travels_once_per_message():
    job = encode_job_(traceparent=TRACE)
    _, one = messages(job, [Item(text="hi")] * 16)
    _, alone = messages(job, [Item(text="hi")] * 16, per_message=1)
    assert len(one) == 1 and len(one[0].payload) < sum(len(m.payload) for m in alone) * 0.15


def test_a_score_job_carries_its_query_and_items_as_its_one_input():
    job = jobs()[2]
    pair = ScoreInput(Item(text="q", id="query"), (Item(text="a" * 40), Item(text="b")))
    items, msgs = messages(job, [pair])
    routes, good = through(msgs)
    assert good == items and routes[0].cost == input_cost(pair) == (2 + 12) + (2 + 2)


@pytest.mark.parametrize("job", jobs()[3:], ids=lambda j: j.operation)
def test_extract_and_tokenize_jobs_travel_too(job):
    items, msgs = messages(job, [Item(text="Ada"), Item(text="Bob")])
    assert through(msgs)[1] == items


def test_the_request_items_count_and_the_message_size_limit():
    inputs = [Item(text="x" * 400) for _ in range(4)]
    _, msgs = messages(encode_job_(), inputs, request_items=4, max_bytes=1400)
    assert [m.slots for m in msgs] == [(0, 1), (2, 3)]
    assert all(len(m.payload) <= 1400 for m in msgs)
    assert {r.request_items for m in msgs for r in WorkCodec.routes(m.headers)} == {4}
    # an item over the limit travels alone, its body too large for a message: the payload store's
    _, big = messages(encode_job_(), [Item(text="y" * 3000), Item(text="z")], max_bytes=1400)
    assert [m.slots for m in big] == [(0,), (1,)]
    off = WorkCodec.offloaded(big[0], "r.0")
    assert (off.payload, off.offloaded, WorkCodec.payload_ref(off.headers)) == (b"", "r.0", "r.0")
    assert off.headers[H_PAYLOAD] == "r.0" and WorkCodec.payload_ref(big[1].headers) is None
    assert len(WorkCodec.routes(off.headers)) == 1
    shared, [own] = WorkCodec.split(big[0].payload, 1)  # what the sidecar reads back from the store
    assert shared and own


def test_headers_survive_any_text_in_their_strings():
    odd = 'org/mödel "x", [y]\r\nNats-Msg-Id: forged'
    _, [msg] = messages(encode_job_(model_id=odd), [Item(text="a")])
    assert "\n" not in msg.headers[H_ROUTE] and "\r" not in msg.headers[H_ROUTE]
    assert WorkCodec.routes(msg.headers)[0].model_spec == odd


def good_headers() -> dict[str, str]:
    return messages(encode_job_(), [Item(text="a"), Item(text="b")])[1][0].headers


ROUTE_EDITS = {
    "bool-request-items": (8, True),
    "zero-request-items": (8, 0),
    "null-reply": (1, None),
    "empty-reply": (1, ""),
    "number-model": (2, 7),
    "text-timestamp": (5, "now"),
}


@pytest.mark.parametrize(
    "broken",
    [None, {}, "no-route", "no-msg-id", "no-items", "not-json", "not-array", "short", *ROUTE_EDITS,
     "items:not json", "items:{}", "items:[]", "items:[[0, 1], [0, 2]]", "items:[[0]]", "items:[[-1, 1]]",
     "items:[[0, 0]]", "items:[[0, true]]", 'items:[["0", 1]]'],
)  # fmt: skip
def test_a_missing_or_malformed_header_is_refused(broken):
    headers = good_headers()
    fields = orjson.loads(headers[H_ROUTE])
    if broken in ("no-route", "no-msg-id", "no-items"):
        del headers[{"no-route": H_ROUTE, "no-msg-id": MSG_ID, "no-items": H_ITEMS}[broken]]
    elif broken == "not-json":
        headers[H_ROUTE] = "[1, 2"
    elif broken == "not-array":
        headers[H_ROUTE] = '{"request_id": "r"}'
    elif broken == "short":
        headers[H_ROUTE] = orjson.dumps(fields[:-1]).decode()
    elif isinstance(broken, str) and broken.startswith("items:"):
        headers[H_ITEMS] = broken[len("items:") :]
    elif isinstance(broken, str):
        pos, value = ROUTE_EDITS[broken]
        fields[pos] = value
        headers[H_ROUTE] = orjson.dumps(fields).decode()
    else:
        headers = broken
    with pytest.raises(ValueError):
        WorkCodec.routes(headers)


def test_a_body_that_does_not_match_its_headers_is_refused():
    _, [msg] = messages(encode_job_(), [Item(text="a"), Item(text="b")])
    for data, count in (
        (msg.payload, 3),
        (packb(["a", "b"]), 2),
        (packb({"a": 1}), 1),
        (b"\xc1", 1),
        (b"", 1),
        (packb([b"job", "not a list"]), 1),
        (packb([b"job", [b"a", 2]]), 2),
    ):
        with pytest.raises(ValueError):
            WorkCodec.split(data, count)


def batch(parts) -> ipc.RunBatchRequest:
    return WorkCodec.run_batch("m", parts, worker_id="w", priority="interactive")


def test_an_item_that_does_not_decode_is_a_dead_letter_and_the_others_run():
    job = encode_job_()
    shared = encode_job(job)
    good_input = packb({"i": 0, "item": {"text": "fine"}})
    bad_job = packb({**unpackb(shared), "request_id": 7})
    unknown_op = packb({**unpackb(shared), "op": "rm -rf"})
    cases = {
        "r.1": (shared, packb({"i": 1, "item": {"text": 5}})),  # a text that is not a string
        "r.2": (shared, packb({"i": 2, "item": "not a map"})),
        "r.3": (shared, packb({"item": {"text": "no index"}})),
        "r.4": (shared, b"\xc1"),
        "r.5": (shared, packb({"i": 9, "item": {"text": "id mismatch"}})),
        "r.6": (bad_job, packb({"i": 6, "item": {"text": "x"}})),
        "r.7": (unknown_op, packb({"i": 7, "item": {"text": "x"}})),
        "r.8": (b"\xc1", packb({"i": 8, "item": {"text": "x"}})),
        "r.9": (shared, packb({"i": 9, "item": {"images": "not a list"}})),
    }
    parts = [("r.0", shared, good_input)] + [(k, s, o) for k, (s, o) in cases.items()]
    good, dead = WorkCodec.job_items(batch(parts))
    assert [it.work_item_id for it in good] == ["r.0"] and good[0].job == job
    assert [d.work_item_id for d in dead] == list(cases)
    assert {d.disposition for d in dead} == {ipc.DEAD_LETTER}
    assert all(d.error and d.error.startswith("undecodable work item") for d in dead)


@pytest.mark.parametrize(
    "change",
    [{"items": "x"}, {"item_ids": [1]}, {"item_job": [5]}, {"item_job": []}, {"jobs": "x"}],
)
def test_a_malformed_batch_is_refused_or_its_items_dead(change):
    request = batch([("r.0", encode_job(encode_job_()), packb({"i": 0, "item": {"text": "a"}}))])
    request = dataclasses.replace(request, **change)
    try:
        good, dead = WorkCodec.job_items(request)
    except ValueError:
        return
    assert good == [] and len(dead) == 1


def test_the_outcomes_come_back_typed_and_a_malformed_one_is_left_out():
    ok = ipc.outcome_from_result(WorkResult("r.0", "r", 0, True, result_msgpack=b"\x80"))
    body = unpackb(packb(ipc.run_batch_response([ok])))
    body["outcomes"] += [{"work_item_id": 3, "disposition": "x"}, "junk", {"disposition": "y"}]
    assert WorkCodec.outcomes(body) == {"r.0": [ok]}
    assert WorkCodec.outcomes({"outcomes": "x"}) == {} == WorkCodec.outcomes(None)


def test_results_travel_in_one_form_and_come_back_as_they_were():
    results = [WorkResult(work_item_id=f"r.{i}", request_id="r", item_index=i, success=True,
                          result_msgpack=bytes([i]) * 10, error_extra={"k": [i]}) for i in range(3)]  # fmt: skip
    assert WorkCodec.results(WorkCodec.results_message([r.to_msgpack() for r in results])) == results
    for bad in (packb({"a": 1}), packb([1, 2]), b"\xc1", packb([packb({"success": "yes"})])):
        with pytest.raises(ValueError):
            WorkCodec.results(bad)


def test_results_are_cut_into_messages_within_the_payload_limit():
    assert WorkCodec.results_chunks([], 100) == []
    assert WorkCodec.results_chunks([10, 10, 10], 1000) == [[0, 1, 2]]
    assert WorkCodec.results_chunks([40, 40, 40], 5 + 45 + 45) == [[0, 1], [2]]
    assert WorkCodec.results_chunks([10, 500, 10], 100) == [[0], [1], [2]]


def test_chunks_keep_within_the_item_count_and_the_payload_limit():
    assert chunk_plan([10] * 5, 2, 1000) == [[0, 1], [2, 3], [4]]
    assert chunk_plan([400, 400, 400, 5000, 10], 32, 1000) == [[0, 1], [2], [3], [4]]
    assert chunk_plan([], 32, 1000) == []


def test_a_message_is_read_back_whole_and_sent_again_or_direct_with_its_own_headers():
    items, [msg] = messages(encode_job_(), [Item(text="a"), Item(text="b")])
    assert WorkCodec.items_of(msg.payload) == items
    for bad in (b"", b"\xc1", packb([b"x", []]), packb({"a": 1})):
        with pytest.raises(ValueError):
            WorkCodec.items_of(bad)
    again = msg.again(2)
    assert again[MSG_ID] == "r.0+2~2" and {k: v for k, v in again.items() if k != MSG_ID} == {
        k: v for k, v in msg.headers.items() if k != MSG_ID
    }
    assert msg.direct("_INBOX.g.taken.r.0")["Sie-Taken"] == "_INBOX.g.taken.r.0"


def test_an_inputs_cost_is_a_chars_over_four_proxy_and_one_per_medium():
    assert text_cost("") == 2 and text_cost("a" * 40) == 12
    assert input_cost(Item(text="a" * 400)) == 102
    assert input_cost(Item(images=[b"x", b"y"])) == 2
    assert input_cost(Item(text="a" * 40, audio=b"x")) == 12 + 1  # text and media both count
    # score: the query counted once per pair
    pair = ScoreInput(Item(text="a" * 8), (Item(text="a" * 4), Item(text="")))
    assert input_cost(pair) == (4 + 3) + (4 + 2)
