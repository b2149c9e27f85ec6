"""protocol.config_delta encode/decode and the config API's token rules."""

from __future__ import annotations

import json

import pytest

from config_service.app import EXPORT, PUBLIC, READ, WRITE, Auth, check_auth
from iokit.http import bearer_token
from protocol.config_delta import (
    MAX_CONFIG_DELTA_BYTES,
    ConfigDelta,
    ConfigDeltaError,
    decode_config_delta,
    encode_config_delta,
)


def test_delta_round_trip_uses_wire_names():
    d = ConfigDelta(
        router_id="sie-config-0",
        bundle_id="default",
        epoch=3,
        bundle_config_hash="abc",
        model_id="org/m",
        profiles_added=["default"],
        model_config="sie_id: org/m\n",
        affected_bundles=["default"],
        pool="default",
        bundle_pool_config_hashes={"default": {"default": "abc"}},
        bundle_adapters={"default": ["worker.adapters.dense"]},
    )
    raw = encode_config_delta(d)
    obj = json.loads(raw)
    assert obj["model_config"] == "sie_id: org/m\n" and "model_config_yaml" not in obj
    assert decode_config_delta(raw) == d
    assert encode_config_delta(decode_config_delta(raw)) == raw
    assert d.expected_hash(pool="DEFAULT") == "abc" and d.expected_hash(pool="other") == "abc"


def test_decode_is_lenient_on_unknown_and_missing_optional_keys():
    d = decode_config_delta('{"producer_id": "sie-config-x", "bundle_id": "b", "epoch": 9, "future": 1}')
    assert d.router_id == "sie-config-x" and d.is_epoch_bump and d.pool == "default"


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1]",
        b'{"bundle_id": "b", "epoch": 1}',
        b'{"router_id": "r", "bundle_id": "b", "epoch": -1}',
        b"\xff",
    ],
)
def test_decode_refuses_bad_payloads(raw):
    with pytest.raises(ConfigDeltaError):
        decode_config_delta(raw)


def test_decode_refuses_oversized_payload():
    with pytest.raises(ConfigDeltaError, match="exceeds"):
        decode_config_delta(b" " * (MAX_CONFIG_DELTA_BYTES + 1))


def test_bearer_token():
    assert bearer_token("  Bearer  abc ") == "abc"
    assert bearer_token("bearer abc") == "abc"
    assert bearer_token("abc") == "abc"


def test_auth_rules():
    full = Auth(admin_token="adm", read_token="rd", inference_token="inf")
    assert check_auth(full, PUBLIC, None) is None
    assert check_auth(full, READ, None).status == 401
    assert check_auth(full, READ, "Bearer inf") is None
    assert check_auth(full, EXPORT, "Bearer inf").status == 403
    assert check_auth(full, EXPORT, "rd") is None
    assert check_auth(full, WRITE, "Bearer rd").status == 403
    assert check_auth(full, WRITE, "Bearer adm") is None
    read_only = Auth(read_token="rd")
    assert check_auth(read_only, WRITE, "Bearer rd").status == 403
    open_dev = Auth()
    assert check_auth(open_dev, WRITE, None) is None
    prod = Auth(production=True)
    assert check_auth(prod, READ, None).status == 403
