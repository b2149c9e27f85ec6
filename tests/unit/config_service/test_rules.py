"""Pure config logic: validation, append-only merge, routing to bundles, hashes, export."""

from __future__ import annotations

import pytest
import yaml

from config_service.rules import (
    UNKNOWN_FIELD_MESSAGE,
    ConfigError,
    ConfigState,
    entry_from_yaml,
    plan_add,
)
from protocol.model_config import Bundle, bundle_config_hash

DENSE = Bundle(name="default", priority=10, adapters=["worker.adapters.dense", "worker.adapters.sparse"])
RERANK = Bundle(name="rerank", priority=5, adapters=["worker.adapters.cross_encoder"])

MODEL = """\
sie_id: org/m
hf_id: org/m
profiles:
  default:
    adapter_path: worker.adapters.dense:Dense
    max_batch_tokens: 1024
"""


def state(*api_yaml: str, epoch: int = 0, baseline: tuple[str, ...] = ()) -> ConfigState:
    api = {e.config.sie_id: e for e in (entry_from_yaml(y) for y in api_yaml)}
    base = {e.config.sie_id: e for e in (entry_from_yaml(y, source="filesystem") for y in baseline)}
    return ConfigState(epoch=epoch, bundles={"default": DENSE, "rerank": RERANK}, baseline=base, api=api)


def refused(st: ConfigState, body: str, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        plan_add(st, body.encode(), **kw)
    return info.value


def test_new_model_is_created_with_canonical_yaml():
    plan = plan_add(state(), MODEL.encode())
    assert plan.is_new_model and plan.changed
    assert plan.created_profiles == ["default"]
    assert yaml.safe_load(plan.entry.raw_yaml) == yaml.safe_load(MODEL)
    assert plan.entry.pool == "default"


def test_identical_replay_changes_nothing():
    plan = plan_add(state(MODEL), MODEL.encode())
    assert not plan.changed
    assert plan.existing_profiles_skipped == ["default"]
    # defaults spelled out (null precision) are still the same profile
    plan = plan_add(state(MODEL), (MODEL + "    compute_precision: null\n").encode())
    assert not plan.changed


def test_append_profile_with_extends_keeps_stored_fields():
    body = "sie_id: org/m\nprofiles:\n  small:\n    extends: default\n    max_batch_tokens: 64\n"
    plan = plan_add(state(MODEL), body.encode())
    assert plan.created_profiles == ["small"] and plan.existing_profiles_skipped == []
    assert plan.entry.config.hf_id == "org/m"
    assert set(plan.entry.config.profiles) == {"default", "small"}


def test_new_top_level_field_is_added_but_changed_one_conflicts():
    plan = plan_add(state(MODEL), (MODEL + "max_sequence_length: 256\n").encode())
    assert plan.changed and plan.added_fields == ["max_sequence_length"] and plan.created_profiles == []
    err = refused(state(MODEL), MODEL.replace("hf_id: org/m", "hf_id: org/other"))
    assert err.status == 409 and err.code == "content_conflict"
    assert err.extra["conflicting_fields"] == ["hf_id"]


def test_changed_profile_conflicts():
    err = refused(state(MODEL), MODEL.replace("1024", "2048"))
    assert (err.status, err.code, err.extra["conflicting_profiles"]) == (409, "content_conflict", ["default"])


def test_unknown_keys_and_wrong_types_are_422():
    err = refused(state(), MODEL + "extra_key: 1\n")
    assert err.status == 422 and err.extra["details"] == [
        {"loc": ["extra_key"], "message": UNKNOWN_FIELD_MESSAGE}
    ]
    err = refused(state(), MODEL.replace("max_batch_tokens: 1024", "max_batch_tokens: [1]"))
    assert err.status == 422 and err.extra["details"][0]["loc"] == ["profiles", "default", "max_batch_tokens"]


def test_parse_and_id_errors_are_400():
    assert refused(state(), "a: [").code == "parse_error"
    assert refused(state(), "just a string").code == "parse_error"
    assert refused(state(), MODEL.replace("org/m\nhf", "bad id\nhf")).code == "invalid_model_id"
    assert refused(state(), MODEL.replace("org/m\nhf", "a\\\\b\nhf")).code == "invalid_model_id"


def test_semantic_rules():
    assert refused(state(), "sie_id: org/x\n").status == 422  # no profiles
    e = refused(
        state(),
        "sie_id: org/x\nprofiles:\n  'bad name':\n    adapter_path: worker.adapters.dense:D\n    max_batch_tokens: 1\n",
    )
    assert e.status == 422 and "profile name" in e.message
    e = refused(state(), "sie_id: org/x\nprofiles:\n  default: {max_batch_tokens: 4}\n")
    assert e.status == 422  # neither adapter_path nor extends
    e = refused(state(), MODEL.replace("worker.adapters.dense:", "worker.adapters.gliner:"))
    assert e.message == "Adapter(s) not in any known bundle: worker.adapters.gliner"
    e = refused(state(), MODEL + "pool: 'bad pool!'\n")
    assert e.status == 422 and "pool" in e.message
    e = refused(state(), MODEL + "routing: {policy: threshold}\n")
    assert "SIE_THRESHOLD_ROUTING_ENABLED" in e.message
    assert plan_add(
        state(), (MODEL + "routing: {policy: threshold}\n").encode(), threshold_routing_enabled=True
    )
    assert "remote_backed" in refused(state(), MODEL + "routing: {policy: remote_only}\n").message


def test_pool_is_lower_cased_and_cannot_change():
    plan = plan_add(state(), (MODEL + "pool: GPU-A\n").encode())
    assert plan.entry.pool == "gpu-a" and plan.entry.data["pool"] == "gpu-a"
    stored = MODEL + "pool: gpu-a\n"
    assert not plan_add(state(stored), (MODEL + "pool: GPU-A\n").encode()).changed
    err = refused(state(stored), MODEL + "pool: other\n")
    assert err.status == 422 and "already exists with different value" in err.message


def test_baseline_model_replay_and_append():
    st = state(baseline=(MODEL,))
    assert not plan_add(st, MODEL.encode()).changed
    body = "sie_id: org/m\nprofiles:\n  x:\n    extends: default\n"
    plan = plan_add(st, body.encode())
    assert plan.created_profiles == ["x"] and not plan.is_new_model and plan.entry.source == "api"


def test_routing_hashes_and_export():
    cross = (
        "sie_id: org/rr\nprofiles:\n  default:\n    adapter_path: worker.adapters.cross_encoder:CE\n"
        "    max_batch_tokens: 512\npool: team\n"
    )
    st = state(MODEL, cross, epoch=7)
    assert st.affected_bundles(st.models["org/rr"].config) == ["rerank"]
    assert st.routable_bundles_by_profile(st.models["org/m"].config) == {"default": ["default"]}
    hashes = st.bundle_config_hashes()
    assert hashes["default"] == bundle_config_hash(DENSE, [e.config for e in st.models.values()])
    assert hashes["rerank"] != "" and hashes["default"] != hashes["rerank"]
    pools = st.bundle_pool_config_hashes()
    assert pools["rerank"]["default"] == "" and pools["rerank"]["team"] == hashes["rerank"]
    info = st.epoch_info()
    assert (
        info["epoch"] == 7
        and len(info["bundles_hash"]) == 64
        and len(info["bundle_config_hashes_hash"]) == 64
    )
    export = st.export()
    assert export["epoch"] == 7 and [m["model_id"] for m in export["models"]] == ["org/m", "org/rr"]
    assert export["models"][1]["pool"] == "team" and export["models"][1]["affected_bundles"] == ["rerank"]
    assert export["generated_at"].endswith("Z")
    # the model-to-pool ownership is part of the fingerprint
    moved = state(MODEL, cross.replace("pool: team", "pool: other"), epoch=7)
    assert moved.bundle_config_hashes() == hashes
    assert moved.bundle_config_hashes_hash() != info["bundle_config_hashes_hash"]
