"""Decoding untrusted bodies (issue 12): whatever a client sends is a value or a CodecError, never
an exception that would surface as a 500."""

from __future__ import annotations

import json

import pytest

from iokit.http import decode_body, loads_json
from protocol.codec import MAX_DEPTH, CodecError, check_plain, packb
from protocol.errors import SIEError


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_nesting_up_to_the_limit_is_fine_one_more_is_refused():
    assert loads_json(nested(MAX_DEPTH).encode()) is not None
    with pytest.raises(CodecError, match="nested deeper"):
        loads_json(nested(MAX_DEPTH + 1).encode())
    with pytest.raises(CodecError):  # Python's own recursion limit, turned into a CodecError
        loads_json(nested(100_000).encode())


def test_integers_must_fit_in_64_bits():
    assert loads_json(str(2**64 - 1).encode()) == 2**64 - 1
    assert loads_json(str(-(2**63)).encode()) == -(2**63)
    for text in (str(2**64), str(-(2**63) - 1), "1" + "0" * 5000):
        with pytest.raises(CodecError):
            loads_json(text.encode())


def test_lone_surrogates_are_refused_pairs_are_text():
    assert loads_json(b'{"t": "\\ud83d\\ude00"}') == {"t": "\U0001f600"}
    for body in (b'{"t": "\\ud800"}', b'["a", {"k\\udfff": 1}]', b'"x\\uDC00"'):
        with pytest.raises(CodecError, match="surrogate"):
            loads_json(body)


def test_check_plain_on_yaml_like_data_checks_keys_and_values():
    check_plain({"a": [1, {"b": "ok"}]})
    with pytest.raises(CodecError):
        check_plain({"\ud800": 1})
    with pytest.raises(CodecError):
        check_plain({"a": [10**30]})


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (nested(MAX_DEPTH + 1).encode(), "application/json"),
        (b'{"items":[{"text":"\\ud800"}]}', "application/json"),
        (("1" + "0" * 4400).encode(), "application/json"),
        (b"\xff", "application/json"),
        (packb(json.loads(nested(MAX_DEPTH + 1))), "application/msgpack"),
        (b"\xc1", "application/msgpack"),
    ],
)
def test_decode_body_answers_invalid_input(body, ctype):
    with pytest.raises(SIEError) as err:
        decode_body(body, ctype)
    assert err.value.code == "INVALID_INPUT" and err.value.status == 400
