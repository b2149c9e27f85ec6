"""The result cache key (protocol/result_cache.py): content-addressed, per-request fields left out,
the model config hash part of it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from protocol.model_config import parse_model_yaml
from protocol.result_cache import CachedAnswer, model_config_hash, pack_entry, unpack_entry, work_item_key
from protocol.work import WorkItem

CONFIG = """
sie_id: acme/m
tasks: {encode: {dense: {dim: 8}}}
profiles:
  default: {adapter_path: "worker.adapters.fake:FakeAdapter", max_batch_tokens: 4096}
"""


def item(**fields) -> WorkItem:
    base = WorkItem("r1.0", "r1", 0, 2, "encode", "acme/m", "default", "default", "cpu", "gw-a",
                    "_INBOX.gw-a.r1", 1.0, item={"text": "hello"}, output_types=["dense"],
                    options={"a": 1, "b": {"y": 2, "x": 1}})  # fmt: skip
    return dataclasses.replace(base, **fields)


def test_requests_for_the_same_content_share_a_key():
    other_request = item(work_item_id="r9.3", request_id="r9", item_index=3, total_items=9, router_id="gw-b",
                         reply_subject="_INBOX.gw-b.r9", timestamp=99.0, deadline=5.0, pool_name="p",
                         machine_profile="l4", bundle="gpu", bundle_config_hash="h")  # fmt: skip
    reordered = item(options={"b": {"x": 1, "y": 2}, "a": 1})
    assert work_item_key(item(), "h1") == work_item_key(other_request, "h1") == work_item_key(reordered, "h1")


@pytest.mark.parametrize(
    "change",
    [
        {"item": {"text": "hello!"}},
        {"output_types": ["dense", "sparse"]},
        {"output_dtype": "int8"},
        {"instruction": "Represent this"},
        {"is_query": True},
        {"options": {"a": 1, "b": {"y": 2, "x": 1}, "lora": "acme/adapter"}},
        {"options": {"a": 2, "b": {"y": 2, "x": 1}}},
        {"profile_id": "fast"},
        {"model_id": "acme/other"},
        {"operation": "extract", "labels": ["person"]},
        {"item": {"text": "hello", "images": [np.zeros(3, dtype=np.uint8)]}},
    ],
)
def test_what_the_result_depends_on_changes_the_key(change):
    assert work_item_key(item(**change), "h1") != work_item_key(item(), "h1")


def test_a_new_model_config_hash_changes_the_key():
    config = parse_model_yaml(CONFIG)
    changed = parse_model_yaml(CONFIG.replace("4096", "2048"))
    assert model_config_hash(config) == model_config_hash(parse_model_yaml(CONFIG))
    assert model_config_hash(config) != model_config_hash(changed)
    assert work_item_key(item(), model_config_hash(config)) != work_item_key(
        item(), model_config_hash(changed)
    )


def test_items_whose_content_is_elsewhere_are_not_cached():
    assert work_item_key(item(payload_ref="s3://bucket/x"), "h1") is None


def test_entries_round_trip_and_foreign_values_are_misses():
    full = CachedAnswer(b"\x81\xa1k\x01", 7, truncated_items=1, dropped_tokens=46)
    assert unpack_entry(pack_entry(full)) == full
    assert unpack_entry(pack_entry(CachedAnswer(b"\x80"))) == CachedAnswer(b"\x80", None, 0, 0)
    for junk in (b"", b"\xc1", b"\x81\xa1r\x01", b"plain text"):
        assert unpack_entry(junk) is None
