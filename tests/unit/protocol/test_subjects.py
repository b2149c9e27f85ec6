"""Subject names, lane prefixes and model specs (protocol/subjects.py, protocol/model_config.py)."""

from __future__ import annotations

import pytest

from protocol.jobs import TokenizeJob
from protocol.model_config import model_spec
from protocol.params import TokenizeOptions
from protocol.subjects import in_lane, lane_filter, lane_prefix, work_subject


def test_work_subjects_and_filters_share_the_lane_prefix():
    prefix = lane_prefix("Default", "L4", "GPU.Bundle")
    assert prefix == "sie.work.default.l4.gpu_dot_bundle."
    assert work_subject("Default", "L4", "GPU.Bundle", "BAAI/bge-m3") == prefix + "BAAI__bge-m3"
    assert lane_filter("Default", "L4", "GPU.Bundle") == prefix + "*"


@pytest.mark.parametrize(
    ("subject", "expected"),
    [
        ("sie.work.default.l4.default.BAAI__bge-m3", True),
        ("sie.work.default.l4.default.", False),  # no model token
        ("sie.work.default.l4.default.a.b", False),  # one token too many
        ("sie.work.default.a100.default.m", False),  # another lane
        ("sie.work.default.l4.defaultx.m", False),
    ],
)
def test_in_lane(subject, expected):
    assert in_lane(subject, lane_prefix("default", "l4", "default")) is expected


@pytest.mark.parametrize(
    ("profile", "expected"),
    [(None, "org/m"), ("", "org/m"), ("default", "org/m"), (" default ", "org/m"), ("fast", "org/m:fast")],
)
def test_model_spec_joins_only_a_non_default_profile(profile, expected):
    assert model_spec("org/m", profile) == expected


def test_a_job_names_its_model_spec():
    fields = dict(request_id="r", model_id="org/m", pool_name="default", machine_profile="l4", router_id="g",
                  reply_subject="_INBOX.g.r", timestamp=0.0, total_items=1,
                  params=TokenizeOptions(options={}, add_special_tokens=True))  # fmt: skip
    assert TokenizeJob(**fields, profile_id="fast").model_spec == "org/m:fast"
    assert TokenizeJob(**fields, profile_id="default").model_spec == "org/m"


def test_work_model_token_names_the_dead_letter_subject():
    from protocol.subjects import work_model_token, work_subject

    assert work_model_token(work_subject("default", "cpu", "default", "acme/m.v1")) == "acme__m_dot_v1"
    for subject in ("", "sie.work.default.cpu", "other.a.b.c.d.e", "sie.work.a.b.c.d.e.f"):
        assert work_model_token(subject) == "unknown"


def test_bulk_work_has_its_own_subjects_and_durable():
    from protocol.streams import lane_consumer_config
    from protocol.subjects import lane_durable, pool_stream_subjects, subject_priority, work_model_token

    prefix = lane_prefix("default", "cpu", "default")
    bulk = work_subject("default", "cpu", "default", "acme/m", "bulk")
    assert bulk == prefix + "acme__m.bulk"
    assert lane_filter("default", "cpu", "default", "bulk") == prefix + "*.bulk"
    assert in_lane(bulk, prefix) and subject_priority(bulk) == "bulk"
    assert subject_priority(work_subject("default", "cpu", "default", "acme/m")) == "interactive"
    assert work_model_token(bulk) == "acme__m"
    assert not in_lane(prefix + "acme__m.other", prefix)
    assert lane_durable("default", "cpu", "default", "bulk") == "default_cpu_default_bulk"
    cfg = lane_consumer_config("default", "cpu", "default", priority="bulk")
    assert cfg["durable_name"] == "default_cpu_default_bulk" and cfg["filter_subject"] == prefix + "*.bulk"
    assert pool_stream_subjects("default") == ["sie.work.default.*.*.*", "sie.work.default.*.*.*.bulk"]
    with pytest.raises(ValueError):
        work_subject("default", "cpu", "default", "acme/m", "urgent")
