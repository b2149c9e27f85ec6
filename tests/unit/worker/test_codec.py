import json

import msgpack
import numpy as np
import pytest

from protocol.codec import CodecError, packb, to_jsonable, unpackb, wants_msgpack_body, wants_msgpack_response


def test_float32_vector_matches_the_contract_example_bytes():
    packed = packb(np.array([1.0, 2.0], dtype=np.float32))
    raw = msgpack.unpackb(packed, raw=True, strict_map_key=False)
    assert list(raw) == [b"nd", b"type", b"kind", b"shape", b"data"]
    assert raw[b"nd"] is True and raw[b"type"] == b"<f4" and raw[b"kind"] == b""
    assert raw[b"shape"] == [2] and raw[b"data"] == bytes.fromhex("0000803f00000040")
    # type is a msgpack str, data is bin
    assert b"\xa3<f4" in packed and b"\xc4\x08" in packed


@pytest.mark.parametrize(
    "dtype", ["<f2", "<f4", "<f8", "<i2", "<i4", "<i8", "|i1", "|u1", "<u4", "|b1", ">f4"]
)
def test_round_trip_every_allowed_dtype(dtype):
    arr = (
        (np.arange(12).reshape(3, 4) % 2 == 0) if dtype == "|b1" else np.arange(12, dtype=dtype).reshape(3, 4)
    )
    out = unpackb(packb({"a": arr, "nested": [{"x": arr[0]}]}))
    assert out["a"].dtype == arr.dtype and np.array_equal(out["a"], arr)
    assert np.array_equal(out["nested"][0]["x"], arr[0])


def test_scalars_and_non_contiguous_arrays():
    arr = np.arange(10, dtype=np.float32)[::2]
    assert np.array_equal(unpackb(packb(arr)), arr)
    assert unpackb(packb(np.float32(1.5))) == np.float32(1.5)


def _array_map(over):
    m = {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [2], b"data": b"\x00" * 8}
    m.update(over)
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.parametrize(
    "bad",
    [
        {b"type": b"<f4"},  # type as bin
        {b"type": "<c8"},  # complex
        {b"kind": b"V"},
        {b"shape": [3]},  # data length mismatch
        {b"shape": [1] * 9},
        {b"nd": 1},
    ],
)
def test_malformed_arrays_are_rejected(bad):
    with pytest.raises(CodecError):
        unpackb(_array_map(bad))


def test_str_keyed_maps_stay_maps_and_garbage_is_an_error():
    assert unpackb(msgpack.packb({"nd": True, "type": "<f4"})) == {"nd": True, "type": "<f4"}
    with pytest.raises(CodecError):
        unpackb(b"\xc1")
    with pytest.raises(CodecError):
        unpackb(msgpack.packb({b"complex": True}, use_bin_type=True))


def test_json_fallback_turns_arrays_into_lists():
    body = to_jsonable({"v": np.array([1.5, 2.0], dtype=np.float32), "b": b"\x00", "n": np.int32(3)})
    assert json.loads(json.dumps(body)) == {"v": [1.5, 2.0], "b": "AA==", "n": 3}


def test_negotiation_rules():
    assert wants_msgpack_body("application/msgpack") and wants_msgpack_body("application/x-msgpack")
    assert not wants_msgpack_body("application/json") and not wants_msgpack_body(None)
    assert wants_msgpack_response(None) and wants_msgpack_response("*/*")
    assert wants_msgpack_response("application/msgpack, application/json")
    assert not wants_msgpack_response("application/json")


def test_json_responses_serialise_arrays_natively_and_nan_as_null():
    from protocol.codec import dumps_json

    vec = np.array([0.5, -1.25, np.nan], dtype=np.float32)
    body = {
        "items": [
            {
                "dense": vec,
                "ids": np.arange(3, dtype=np.int32),
                "raw": b"\x00\x01",
                "strided": np.arange(6, dtype=np.float32)[::2],
                "n": np.float32(2.5),
            }
        ]
    }
    out = json.loads(dumps_json(body))
    item = out["items"][0]
    assert item["dense"] == [0.5, -1.25, None] and item["ids"] == [0, 1, 2]
    assert item["raw"] == "AAE=" and item["strided"] == [0.0, 2.0, 4.0] and item["n"] == 2.5
