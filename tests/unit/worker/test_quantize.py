import numpy as np

from worker.runtime.postprocess import encode_item, quantize_rows


def test_int8_symmetric_per_row():
    x = np.array([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], dtype=np.float32)
    q = quantize_rows(x, "int8")
    assert q.dtype == np.int8
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]  # round(0.5*127)=64 (63.5 rounds to even 64)


def test_uint8_min_max_per_row_and_constant_rows():
    x = np.array([[-1.0, 0.0, 1.0], [3.0, 3.0, 3.0]], dtype=np.float32)
    q = quantize_rows(x, "uint8")
    assert q.dtype == np.uint8
    assert q.tolist() == [[0, 128, 255], [128, 128, 128]]


def test_binary_packs_sign_bits_msb_first():
    x = np.array([1, -1, 0, 2, -3, 4, 5, -6, 7], dtype=np.float32)
    q = quantize_rows(x, "binary")
    assert q.tolist() == [0b10010110, 0b10000000]
    assert np.array_equal(quantize_rows(x, "ubinary"), q)


def test_float16_and_float32():
    x = np.array([1 / 3, 2.0], dtype=np.float32)
    assert quantize_rows(x, "float16").dtype == np.float16
    assert quantize_rows(x, "float32") is not None and quantize_rows(x, "float32").dtype == np.float32


def test_encode_item_shapes_and_labels():
    raw = {
        "dense": np.array([0.1, -0.2, 0.3], dtype=np.float32),
        "sparse": (np.array([7, 2], dtype=np.int64), np.array([0.7, 0.2], dtype=np.float32)),
        "multivector": np.ones((2, 3), dtype=np.float32),
    }
    out = encode_item(raw, "binary", {"dense": 3, "sparse": 10}, "id-1")
    assert out["id"] == "id-1"
    assert out["dense"]["dims"] == 3 and out["dense"]["dtype"] == "binary"
    assert out["dense"]["values"].tolist() == [0b10100000]
    # sparse: indices sorted ascending, int32, values stay float32 for binary
    assert out["sparse"]["indices"].tolist() == [2, 7] and out["sparse"]["indices"].dtype == np.int32
    assert out["sparse"]["values"].dtype == np.float32 and out["sparse"]["values"].tolist() == [
        np.float32(0.2),
        np.float32(0.7),
    ]
    assert out["multivector"]["num_tokens"] == 2 and out["multivector"]["values"].shape == (2, 1)
