"""Work-stream reconciliation (protocol/streams.py): the decision both the gateway and the sidecar use."""

from __future__ import annotations

from enum import Enum

from protocol.streams import (
    CONTRACT_STREAM_FIELDS,
    reconcile_stream,
    stream_config,
    stream_fields,
)


class Discard(Enum):  # stands in for nats-py's enums: compared by value
    NEW = "new"


def current_of(cfg: dict, **changes) -> dict:
    return stream_fields({**cfg, **changes})


def test_a_missing_stream_is_created_as_desired():
    cfg = stream_config("default", max_msgs=5)
    plan = reconcile_stream(None, cfg)
    assert plan.action == "create" and plan.config == cfg


def test_an_equal_stream_is_kept():
    cfg = stream_config("default")
    assert reconcile_stream(current_of(cfg, discard=Discard.NEW), cfg).action == "keep"


def test_the_gateway_reconciles_limits():
    cfg = stream_config("default", max_msgs=5_000)
    plan = reconcile_stream(current_of(cfg, max_msgs=100_000), cfg)
    assert plan.action == "update" and plan.changed == ("max_msgs",)
    assert plan.config["max_msgs"] == 5_000


def test_contract_fields_only_leave_an_operators_limits_alone():
    operator = stream_config("default", max_msgs=5_000, max_age_s=60.0, replicas=3)
    sidecar = stream_config("default")  # the sidecar's defaults: 100,000 messages, 30 minutes, 1 replica
    assert reconcile_stream(stream_fields(operator), sidecar, fields=CONTRACT_STREAM_FIELDS).action == "keep"
    # a contract field differs: the update carries the server's limits, not the sidecar's defaults
    plan = reconcile_stream(current_of(operator, discard="old"), sidecar, fields=CONTRACT_STREAM_FIELDS)
    assert plan.action == "update" and plan.changed == ("discard",)
    assert plan.config["discard"] == "new"
    assert (plan.config["max_msgs"], plan.config["max_age"], plan.config["num_replicas"]) == (5_000, 60.0, 3)


def test_storage_never_changes_in_place_and_a_mismatch_is_reported():
    cfg = stream_config("default", storage="file", max_msgs=9)
    plan = reconcile_stream(current_of(cfg, storage="memory", max_msgs=1), cfg)
    assert plan.action == "update" and plan.config["storage"] == "memory"
    assert plan.storage_mismatch == ("memory", "file")
    kept = reconcile_stream(current_of(cfg, storage="memory"), cfg)
    assert kept.action == "keep" and kept.storage_mismatch == ("memory", "file")


def test_stream_fields_reads_objects_and_maps():
    class Config:
        storage = "file"
        subjects = ["s"]
        max_age = 1.0
        max_msgs = 2
        discard = Discard.NEW
        num_replicas = 1

    from_obj = stream_fields(Config())
    assert from_obj == {
        "storage": "file",
        "subjects": ["s"],
        "max_age": 1.0,
        "max_msgs": 2,
        "discard": "new",
        "num_replicas": 1,
    }
    assert stream_fields(dict(from_obj)) == from_obj
