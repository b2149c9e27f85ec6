"""An answer becomes one line of a batch's output file (gateway/batches.py one_line_json)."""

from __future__ import annotations

import orjson

from gateway.batches import one_line_json


def test_a_compact_answer_is_kept_byte_for_byte():
    raw = orjson.dumps({"data": [{"embedding": [0.1, -2.5e-07]}]})
    assert one_line_json(raw + b"\n") == raw


def test_an_answer_over_several_lines_is_made_one_line():
    raw = b'{\n  "object": "list",\n  "data": []\n}\n'
    line = one_line_json(raw)
    assert b"\n" not in line and orjson.loads(line) == {"object": "list", "data": []}


def test_an_answer_that_is_not_json_becomes_an_error_message():
    line = one_line_json(b"<html>502 Bad Gateway</html>")
    assert orjson.loads(line) == {"error": {"message": "<html>502 Bad Gateway</html>"}}
    assert one_line_json(b"") == b"null"
