"""protocol.params: each operation's parameters checked and resolved by one function, the one the
gateway and the worker both call."""

from __future__ import annotations

import pytest

from protocol.api import EncodeParams, ExtractParams, Item, ScoreParams, TokenizeParams
from protocol.catalog import Catalog
from protocol.errors import SIEError
from protocol.model_config import ModelConfig
from protocol.params import (
    ChunkSpec,
    MuveraConfig,
    check_items,
    encode_options,
    extract_options,
    score_options,
    tokenize_options,
)

FAKE = "worker.adapters.fake:FakeAdapter"


def catalog() -> Catalog:
    def config(sie_id: str, tasks: dict, **extra) -> ModelConfig:
        profiles = {
            "default": {"adapter_path": FAKE, "max_batch_tokens": 512},
            "query": {
                "adapter_path": FAKE,
                "max_batch_tokens": 512,
                "adapter_options": {"runtime": {"is_query": True, "output_dtype": "int8"}},
            },
        }
        return ModelConfig.model_validate({"sie_id": sie_id, "tasks": tasks, "profiles": profiles, **extra})

    return Catalog(
        [
            config(
                "emb",
                {"encode": {"dense": {"dim": 8}, "multivector": {"dim": 4}}},
                inputs={"text": True},
                loras={"l": {"path": "/srv/adapters/l"}, "other": {"hf_id": "acme/other-lora"}},
            ),
            config("rank", {"score": {}}, inputs={"text": True}),
            config("ner", {"extract": {}}, inputs={"text": True}),
            config("img", {"encode": {"dense": {"dim": 8}}}, inputs={"text": False, "image": True}),
        ]
    )


def refused(call, param: str) -> str:
    with pytest.raises(SIEError) as err:
        call()
    assert err.value.status == 400 and err.value.param == param, (err.value.param, err.value.message)
    return err.value.message


def test_encode_options_apply_the_profile_and_let_the_request_win():
    resolved = catalog().resolve("emb:query")
    opts = encode_options(resolved, None)
    assert (opts.is_query, opts.output_dtype, opts.output_types) == (True, "int8", ("dense",))
    mine = encode_options(
        resolved, EncodeParams(output_dtype="float16", instruction="find", options={"lora": "l"})
    )
    assert (mine.output_dtype, mine.instruction, mine.lora) == ("float16", "find", "l")
    assert "profile" not in encode_options(resolved, EncodeParams(options={"profile": "query"})).options


def test_a_lora_is_selected_by_a_declared_name():
    resolved = catalog().resolve("emb")
    assert encode_options(resolved, EncodeParams(options={"lora_id": "other"})).lora == "other"
    for unset in (None, ""):
        assert encode_options(resolved, EncodeParams(options={"lora": unset})).lora is None


ATTACKS = [
    "/etc",
    "~",
    "../..",
    "/proc/self",
    "./l",
    "acme/other-lora",
    "some-org/undeclared",
    "L",
    "x" * 10_000,
]


@pytest.mark.parametrize("value", [*ATTACKS, ["l"], {"path": "/etc"}, 7])
def test_anything_but_a_declared_lora_name_is_refused_naming_the_declared_ones(value):
    resolved = catalog().resolve("emb")
    message = refused(lambda: encode_options(resolved, EncodeParams(options={"lora": value})), "lora")
    assert message.endswith("model 'emb' declares: l, other"), message
    assert len(message) < 200
    if isinstance(value, str):  # the client's string is never repeated
        assert f"'{value}'" not in message and (len(value) < 3 or value not in message), message


@pytest.mark.parametrize(
    ("spec", "call"),
    [
        ("rank", lambda r, o: score_options(r, ScoreParams(options=o))),
        ("ner", lambda r, o: extract_options(r, ExtractParams(options=o))),
        ("img", lambda r, o: encode_options(r, EncodeParams(options=o))),
    ],
)
@pytest.mark.parametrize("value", ["/etc", "l", "acme/other-lora"])
def test_a_lora_on_a_model_declaring_none_is_refused(spec, call, value):
    resolved = catalog().resolve(spec)
    message = refused(lambda: call(resolved, {"lora": value}), "lora")
    assert message == f"Model '{spec}' declares no LoRA adapters"


def test_encode_options_derive_matryoshka_muvera_and_chunking():
    resolved = catalog().resolve("emb")
    assert encode_options(resolved, EncodeParams(options={"output_dim": 4})).output_dim == 4
    muvera = encode_options(resolved, EncodeParams(options={"muvera": {"num_repetitions": 2}}))
    assert muvera.muvera == MuveraConfig(num_repetitions=2)
    chunk = encode_options(resolved, EncodeParams(options={"overflow_policy": "chunk", "chunk_size": 64}))
    assert chunk.chunk == ChunkSpec(size=64)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (EncodeParams(output_types=["sparse"]), "output_types"),
        (EncodeParams(output_dtype="int4"), "output_dtype"),
        (EncodeParams(options={"pooling": "sum"}), "pooling"),
        (EncodeParams(options={"max_seq_length": 0}), "max_seq_length"),
        (EncodeParams(options={"overflow_policy": "drop"}), "overflow_policy"),
        (EncodeParams(options={"output_dim": 9}), "output_dim"),
        (EncodeParams(options={"muvera": {"seed": -1}}), "options.muvera.seed"),
        (EncodeParams(output_types=["multivector"], options={"overflow_policy": "chunk"}), "overflow_policy"),
    ],
)
def test_a_bad_encode_parameter_is_refused_naming_it(params, param):
    refused(lambda: encode_options(catalog().resolve("emb"), params), param)


def test_each_operation_needs_a_model_that_does_it():
    c = catalog()
    assert (
        refused(lambda: score_options(c.resolve("emb"), None), "model")
        == "Model 'emb' does not support scoring"
    )
    assert refused(lambda: extract_options(c.resolve("emb"), None), "model") == (
        "Model 'emb' does not support extraction"
    )
    assert (
        refused(lambda: tokenize_options(c.resolve("img"), None), "model") == "Model 'img' does not take text"
    )
    with pytest.raises(SIEError, match="does not support encoding"):
        encode_options(c.resolve("rank"), None)


def test_score_extract_and_tokenize_options():
    c = catalog()
    score = score_options(c.resolve("rank"), ScoreParams(options={"overflow_policy": "chunk"}))
    assert score.chunk == ChunkSpec() and score.truncate
    extract = extract_options(
        c.resolve("ner"), ExtractParams(options={"labels": ["person"]}, output_schema={})
    )
    assert extract.labels == ("person",) and extract.output_schema is None
    refused(lambda: extract_options(c.resolve("ner"), ExtractParams(options={"labels": "person"})), "labels")
    refused(
        lambda: extract_options(c.resolve("ner"), ExtractParams(options={"overflow_policy": "chunk"})),
        "overflow_policy",
    )
    assert not tokenize_options(
        c.resolve("emb"), TokenizeParams(options={"add_special_tokens": False})
    ).add_special_tokens


def test_items_are_checked_against_what_the_model_takes():
    c = catalog()
    check_items(c.resolve("emb"), [Item(text="fine")], 8)
    assert refused(lambda: check_items(c.resolve("emb"), [Item(text="x"), Item()], 8), "items.1.text") == (
        "Item 1 has no text"
    )
    refused(lambda: check_items(c.resolve("emb"), [Item(text="123456789")], 8), "items.0.text")
    refused(lambda: check_items(c.resolve("emb"), [Item(text="x", audio=b"a")], 8), "items.0.audio")
    check_items(c.resolve("img"), [Item(images=[b"x"])], 8)  # media instead of text
