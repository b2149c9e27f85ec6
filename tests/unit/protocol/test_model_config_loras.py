"""A model config's ``loras:`` block: the adapters requests may select by name (issue 56)."""

from __future__ import annotations

import textwrap

import pytest

from protocol.model_config import Bundle, ModelConfig, ValidationError, bundle_config_hash, parse_model_yaml

SHA = "ab" * 32


def config(loras=None, **extra) -> ModelConfig:
    data = {
        "sie_id": "org/model",
        "tasks": {"encode": {"dense": {"dim": 8}}},
        "profiles": {"default": {"adapter_path": "fake:Adapter", "max_batch_tokens": 512}},
        **extra,
    }
    if loras is not None:
        data["loras"] = loras
    return ModelConfig.model_validate(data)


def test_a_loras_block_in_yaml():
    parsed = parse_model_yaml(
        textwrap.dedent(f"""
        sie_id: org/model
        tasks: {{encode: {{dense: {{dim: 8}}}}}}
        loras:
          legal: {{hf_id: acme/legal-lora, revision: 5d1c0f3, sha256: {SHA}}}
          medical_v2: {{path: /srv/adapters/medical}}
          packaged: {{path: "pkg://acme_adapters/support"}}
        profiles:
          default: {{adapter_path: "fake:Adapter", max_batch_tokens: 512}}
        """)
    )
    assert parsed.lora_names() == ["legal", "medical_v2", "packaged"]
    legal = parsed.lora("legal")
    assert legal is not None
    assert (legal.hf_id, legal.path, legal.revision, legal.sha256) == (
        "acme/legal-lora",
        None,
        "5d1c0f3",
        SHA,
    )
    assert parsed.lora("medical") is None


def test_no_loras_declared():
    for c in (config(), config({})):
        assert c.lora_names() == [] and c.lora("x") is None
    assert "loras" not in config().model_dump(exclude_none=True)  # exports of old configs unchanged


@pytest.mark.parametrize(
    "entry",
    [
        {},  # no source
        {"hf_id": "acme/a", "path": "/srv/a"},  # two sources
        {"hf_id": "acme"},  # not org/name
        {"hf_id": "acme/a/b"},
        {"hf_id": "../etc/passwd"},
        {"hf_id": "acme/.."},
        {"hf_id": "https://evil.example/a"},
        {"hf_id": "/abs/a"},
        {"hf_id": "acme/a\n"},
        {"path": ""},
        {"path": "/srv/a", "revision": "main"},  # a revision is of a hub id
        {"hf_id": "acme/a", "revision": " "},
        {"hf_id": "acme/a", "sha256": "AB" * 32},  # lowercase hex
        {"hf_id": "acme/a", "sha256": "ab" * 31},
        {"hf_id": "acme/a", "sha256": "ab" * 32 + "\n"},
        {"hf_id": "acme/a", "url": "https://x"},  # unknown key
        "acme/a",  # not a mapping
    ],
)
def test_a_bad_entry_is_refused(entry):
    with pytest.raises(ValidationError):
        config({"ok": entry})


@pytest.mark.parametrize("name", ["", "a.b", ".", "..", "-x", "_x", "a/b", "~", "a b", "é", "a\n", "x" * 129])
def test_a_bad_name_is_refused(name):
    with pytest.raises(ValidationError) as err:
        config({name: {"path": "/srv/a"}})
    assert "x" * 129 not in str(err.value)  # a long name is not repeated whole


@pytest.mark.parametrize("name", ["a", "A1", "legal-v2", "medical_v2", "x" * 128])
def test_good_names(name):
    assert config({name: {"path": "/srv/a"}}).lora_names() == [name]


def test_declared_loras_count_in_the_bundle_config_hash():
    bundle = Bundle(name="default", adapters=["fake"])
    base = bundle_config_hash(bundle, [config()])
    assert base == bundle_config_hash(bundle, [config({})])  # none declared: the hash it always had
    one = bundle_config_hash(bundle, [config({"one": {"path": "/srv/one"}})])
    assert one not in (base, "")
    assert one == bundle_config_hash(bundle, [config({"one": {"path": "/srv/one"}})])
    for changed in (
        {"one": {"path": "/srv/other"}},
        {"uno": {"path": "/srv/one"}},
        {"one": {"path": "/srv/one", "sha256": SHA}},
        {"one": {"path": "/srv/one"}, "two": {"hf_id": "acme/two"}},
    ):
        assert bundle_config_hash(bundle, [config(changed)]) not in (base, one)
    # the order they are written in does not matter
    a = config({"a": {"path": "/a"}, "b": {"hf_id": "acme/b"}})
    b = config({"b": {"hf_id": "acme/b"}, "a": {"path": "/a"}})
    assert bundle_config_hash(bundle, [a]) == bundle_config_hash(bundle, [b])
