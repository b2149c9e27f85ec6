"""The typed RunBatch outcome: the map the sidecar reads, field for field and byte for byte."""

from __future__ import annotations

from protocol import ipc
from protocol.codec import packb
from protocol.errors import ErrorCode
from protocol.work import WorkResult


def result(**kw) -> WorkResult:
    return WorkResult(work_item_id="r.0", request_id="r", item_index=0, **kw)


def test_a_success_carries_its_encoded_result_and_tokens():
    res = result(success=True, result_msgpack=b"\x80", input_tokens=7)
    out = ipc.outcome_from_result(res)
    assert out.to_map() == {
        "work_item_id": "r.0",
        "disposition": ipc.PUBLISH_AND_ACK,
        "input_tokens": 7,
        "result": res.to_msgpack(),
    }
    assert list(out.to_map()) == ["work_item_id", "disposition", "input_tokens", "result"]


def test_a_retryable_failure_is_a_nak_with_its_delay_and_no_result():
    res = WorkResult.failure(result(success=False), ErrorCode.MODEL_LOADING, "loading", retry_after_s=1.5)
    assert ipc.outcome_from_result(res).to_map() == {
        "work_item_id": "r.0",
        "disposition": ipc.NAK_RETRY,
        "error_code": ErrorCode.MODEL_LOADING,
        "nak_delay_ms": 1500,
    }


def test_a_permanent_failure_is_published():
    res = WorkResult.failure(result(success=False), ErrorCode.INVALID_INPUT, "bad")
    out = ipc.outcome_from_result(res)
    assert out.disposition == ipc.PUBLISH_ERROR_AND_ACK and out.result == res.to_msgpack()
    assert list(out.to_map()) == ["work_item_id", "disposition", "error_code", "result"]


def test_the_response_round_trips_and_keeps_the_wire_bytes():
    dead = ipc.ItemOutcome("r.1", ipc.DEAD_LETTER, error="undecodable work item: no")
    ok = ipc.outcome_from_result(result(success=True, result_msgpack=b"\x80"))
    body = ipc.run_batch_response([ok, dead])
    assert packb(body) == packb(
        {
            "outcomes": [
                {"work_item_id": "r.0", "disposition": ipc.PUBLISH_AND_ACK, "result": ok.result},
                {"work_item_id": "r.1", "disposition": ipc.DEAD_LETTER, "error": "undecodable work item: no"},
            ]
        }
    )
    assert [ipc.ItemOutcome.from_map(m) for m in body["outcomes"]] == [ok, dead]
