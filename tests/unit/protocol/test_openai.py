"""The OpenAI /v1/embeddings request and response (protocol/openai.py), shared by gateway and sie serve."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from protocol.errors import ErrorCode, SIEError
from protocol.openai import (
    dimension_options,
    embedding_row,
    embeddings_response,
    models_response,
    parse_embeddings_request,
    resolve_model,
)


def refused(data, max_inputs=8) -> SIEError:
    with pytest.raises(SIEError) as exc_info:
        parse_embeddings_request(data, max_inputs=max_inputs)
    assert exc_info.value.code == ErrorCode.INVALID_INPUT
    return exc_info.value


def test_a_string_input_is_one_item_and_defaults_apply():
    req = parse_embeddings_request({"model": "m", "input": "hi", "user": "ignored"}, max_inputs=8)
    assert (req.model, req.inputs, req.encoding_format, req.dimensions) == ("m", ["hi"], "float", None)


def test_fields_are_read():
    req = parse_embeddings_request(
        {"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8}, max_inputs=8
    )
    assert (req.inputs, req.encoding_format, req.dimensions) == (["a", "b"], "base64", 8)


@pytest.mark.parametrize(
    ("data", "param", "message"),
    [
        ([], None, "Request body must be a JSON object"),
        ({"input": "x"}, "model", "'model' is required"),
        ({"model": "", "input": "x"}, "model", "'model' is required"),
        ({"model": "m", "input": 3}, "input", "'input' must be a string or an array of strings"),
        ({"model": "m"}, "input", "'input' must be a string or an array of strings"),
        ({"model": "m", "input": []}, "input", "Input cannot be empty"),
        ({"model": "m", "input": [[1, 2]]}, "input", "token-array embeddings input is not supported"),
        ({"model": "m", "input": ["a"] * 9}, "input", "At most 8 inputs per request"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format must"),
    ],
)
def test_bad_requests_name_the_field(data, param, message):
    err = refused(data)
    assert err.param == param and err.message.startswith(message)


def test_dimensions_below_native_truncate_and_others_are_refused():
    assert dimension_options(None, 384) == {} and dimension_options(384, 384) == {}
    assert dimension_options(128, 384) == {"output_dim": 128}
    for bad in (385, 0, -1, "128", True, 1.5):
        with pytest.raises(SIEError) as exc_info:
            dimension_options(bad, 384)
        err = exc_info.value
        assert err.code == ErrorCode.INVALID_INPUT and err.param == "dimensions"
        assert err.extra["openai_code"] == "unsupported_field" and "384" in err.message


def test_models_list_answers_sie_and_openai_clients():
    body = models_response([{"name": "a/b", "loaded": True}, {"name": "c:bf16", "loaded": False}])
    assert body["models"][0]["loaded"] is True
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["a/b", "c:bf16"]
    assert all(m["object"] == "model" for m in body["data"])


def test_rows_as_floats_or_little_endian_base64():
    values = np.array([[0.5, -1.25, 3.0]], dtype=np.float32)
    assert embedding_row(values, 2, "float") == {
        "object": "embedding",
        "embedding": [0.5, -1.25, 3.0],
        "index": 2,
    }
    row = embedding_row(values, 0, "base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4"), values.reshape(-1))


def test_usage_counts_worker_tokens_or_estimates_from_characters():
    body = embeddings_response("m", [], ["abcdefgh"], 5)
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "sie_token_source": "worker"}
    assert embeddings_response("m", [], ["abcdefgh", "ab"], None)["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 2,
        "sie_token_source": "character_estimate",
    }
    assert embeddings_response("m", [], ["a"], None)["usage"]["prompt_tokens"] == 1


def test_an_unknown_model_is_reported_against_param_model():
    def resolve(name: str):
        raise SIEError(ErrorCode.MODEL_NOT_FOUND, f"Model '{name}' not found")

    with pytest.raises(SIEError) as exc_info:
        resolve_model(resolve, "nope")
    assert exc_info.value.code == ErrorCode.MODEL_NOT_FOUND and exc_info.value.param == "model"
    assert resolve_model(lambda name: name.upper(), "ok") == "OK"
