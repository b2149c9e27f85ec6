"""The result cache key (protocol/result_cache.py): content-addressed, per-request fields left out,
the model config hash part of it."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.api import Item
from protocol.jobs import EncodeJob, ExtractJob, JobItem
from protocol.model_config import parse_model_yaml
from protocol.params import EncodeOptions, ExtractOptions
from protocol.result_cache import CachedAnswer, job_item_keys, model_config_hash, pack_entry, unpack_entry

CONFIG = """
sie_id: acme/m
tasks: {encode: {dense: {dim: 8}}}
profiles:
  default: {adapter_path: "worker.adapters.fake:FakeAdapter", max_batch_tokens: 4096}
"""


def key(item: JobItem, config_hash: str) -> str:
    return job_item_keys([item], config_hash)[0]


def item(
    *, index: int = 0, item: Item | None = None, params: dict | None = None, job: type = EncodeJob, **fields
) -> JobItem:
    route = dict(request_id="r1", model_id="acme/m", profile_id="default", pool_name="default",
                 machine_profile="cpu", router_id="gw-a", reply_subject="_INBOX.gw-a.r1", timestamp=1.0,
                 total_items=2)  # fmt: skip
    route.update(fields)
    if job is ExtractJob:
        opts = ExtractOptions(options={}, labels=("person",), output_schema=None, instruction=None, lora=None,
                              max_length=None, truncate=True)  # fmt: skip
    else:
        base = dict(options={"a": 1, "b": {"y": 2, "x": 1}}, output_types=("dense",), output_dtype="float32",
                    instruction=None, is_query=False, lora=None, max_length=None, truncate=True, normalize=True,
                    output_dim=None, muvera=None, chunk=None)  # fmt: skip
        opts = EncodeOptions(**{**base, **(params or {})})
    return JobItem(job(**route, params=opts), index, item or Item(text="hello"))


def test_requests_for_the_same_content_share_a_key():
    other_request = item(index=3, request_id="r9", total_items=9, router_id="gw-b", reply_subject="_INBOX.gw-b.r9",
                         timestamp=99.0, deadline=5.0, pool_name="p", machine_profile="l4", bundle="gpu",
                         bundle_config_hash="h")  # fmt: skip
    reordered = item(params={"options": {"b": {"x": 1, "y": 2}, "a": 1}})
    assert key(item(), "h1") == key(other_request, "h1") == key(reordered, "h1")


@pytest.mark.parametrize(
    "change",
    [
        {"item": Item(text="hello!")},
        {"params": {"output_types": ("dense", "sparse")}},
        {"params": {"output_dtype": "int8"}},
        {"params": {"instruction": "Represent this"}},
        {"params": {"is_query": True}},
        {"params": {"lora": "acme/adapter"}},
        {"params": {"options": {"a": 2, "b": {"y": 2, "x": 1}}}},
        {"profile_id": "fast"},
        {"model_id": "acme/other"},
        {"job": ExtractJob},
        {"item": Item(text="hello", images=[np.zeros(3, dtype=np.uint8)])},
    ],
)
def test_what_the_result_depends_on_changes_the_key(change):
    assert key(item(**change), "h1") != key(item(), "h1")


def test_the_items_of_one_job_are_keyed_at_once_as_each_alone():
    first, second = item(), item(index=1, item=Item(text="other"))
    second = JobItem(first.job, 1, second.input)
    assert job_item_keys([first, second], "h1") == [key(first, "h1"), key(second, "h1")]
    assert len(set(job_item_keys([first, second], "h1"))) == 2


def test_a_new_model_config_hash_changes_the_key():
    config = parse_model_yaml(CONFIG)
    changed = parse_model_yaml(CONFIG.replace("4096", "2048"))
    assert model_config_hash(config) == model_config_hash(parse_model_yaml(CONFIG))
    assert model_config_hash(config) != model_config_hash(changed)
    assert key(item(), model_config_hash(config)) != key(item(), model_config_hash(changed))


def test_entries_round_trip_and_foreign_values_are_misses():
    full = CachedAnswer(b"\x81\xa1k\x01", 7, truncated_items=1, dropped_tokens=46)
    assert unpack_entry(pack_entry(full)) == full
    assert unpack_entry(pack_entry(CachedAnswer(b"\x80"))) == CachedAnswer(b"\x80", None, 0, 0)
    for junk in (b"", b"\xc1", b"\x81\xa1r\x01", b"plain text"):
        assert unpack_entry(junk) is None
