"""HTTP plumbing every front door shares (iokit/http.py): error mapping, timing headers, bearer tokens."""

from __future__ import annotations

import json
import os

import pytest
from aiohttp import web

from iokit.http import error_for_http_exception, error_response, unexpected_error
from protocol.errors import ErrorCode


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (web.HTTPRequestEntityTooLarge(max_size=10, actual_size=11), 413, ErrorCode.INPUT_TOO_LONG),
        (web.HTTPNotFound(), 404, ErrorCode.NOT_FOUND),
        (web.HTTPMethodNotAllowed("PATCH", ["GET"]), 405, ErrorCode.INVALID_INPUT),
        (web.HTTPBadRequest(), 400, ErrorCode.INVALID_INPUT),
    ],
)
def test_http_exceptions_map_to_one_code_per_status(exc, status, code):
    err = error_for_http_exception(exc)
    assert (err.status, err.code) == (status, code)
    resp = error_response(err, "rid")
    body = json.loads(resp.body)
    assert resp.status == status and body["detail"]["code"] == code
    assert resp.headers["X-SIE-Error-Code"] == code and resp.headers["X-SIE-Request-ID"] == "rid"


def test_an_unexpected_exception_says_only_its_type():
    err = unexpected_error(KeyError("secret"))
    assert (err.status, err.code) == (500, ErrorCode.INTERNAL_ERROR)
    assert err.message == "internal error: KeyError"


def test_timing_headers_leave_out_what_took_no_time_or_was_not_counted():
    from iokit.http import timing_headers

    assert timing_headers(queue_ms=1.234, tokenization_ms=0.0, inference_ms=5.0) == {
        "X-Queue-Time": "1.23",
        "X-Inference-Time": "5.00",
    }
    full = timing_headers(
        queue_ms=1, tokenization_ms=2, inference_ms=3, postprocessing_ms=4, total_ms=10, input_tokens=7
    )
    assert full == {
        "X-Queue-Time": "1.00",
        "X-Inference-Time": "3.00",
        "X-Tokenization-Time": "2.00",
        "X-Postprocessing-Time": "4.00",
        "X-Total-Time": "10.00",
        "X-SIE-Units-Input-Tokens": "7",
    }


def test_bearer_tokens_and_matching():
    from iokit.http import bearer_token, token_matches

    assert bearer_token(None) is None and bearer_token("  ") is None
    assert bearer_token("BEARER t1") == "t1"
    assert token_matches("t1", ["x", "t1"])
    assert not token_matches("t1", ["x", None, ""])
    assert not token_matches("", ["", None])  # an unset token never matches


def test_request_ids_are_uuid7_text_and_time_ordered():
    import time
    import uuid

    from iokit.http import new_request_id

    ids = []
    for _ in range(50):
        ids.append(new_request_id())
        time.sleep(0.002)  # a new millisecond: the ids sort as they were made
    for rid in ids:
        parsed = uuid.UUID(rid)
        assert str(parsed) == rid  # the canonical text form
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    ms = int(ids[-1].replace("-", "")[:12], 16)
    assert abs(ms / 1000 - time.time()) < 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_hands_out_ids_of_its_own():
    from iokit.http import new_request_id

    new_request_id()  # the parent holds random bytes read ahead
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, through the pipe
        os.write(write, "\n".join(new_request_id() for _ in range(20)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = set(f.read().split("\n"))
    parent = {new_request_id() for _ in range(20)}
    assert len(child) == 20 and not child & parent
    # the random parts too, not only the timestamps
    assert not {c[15:] for c in child} & {p[15:] for p in parent}
