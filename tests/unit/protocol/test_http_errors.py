"""HTTP errors every front door renders the same way (protocol/http.py)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from protocol.errors import ErrorCode
from protocol.http import error_for_http_exception, error_response, unexpected_error


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
