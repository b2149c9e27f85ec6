"""Lane choice and profile canonicalisation (gateway/routing.py): pure functions, no NATS."""

from __future__ import annotations

import pytest

from gateway.routing import (
    Lane,
    best_lane,
    canonical_profile,
    lane_served,
    provisioning_message,
    split_routing_headers,
)
from gateway.workers import WorkerRecord
from protocol.errors import ErrorCode, SIEError
from protocol.work import Heartbeat


def worker(
    wid: str,
    profile: str,
    bundle: str,
    *,
    depth: int = 0,
    loaded: tuple[str, ...] = (),
    pool: str = "default",
) -> WorkerRecord:
    hb = Heartbeat(
        name=wid,
        ready=True,
        machine_profile=profile,
        pool_name=pool,
        bundle=bundle,
        queue_depth=depth,
        loaded_models=list(loaded),
    )
    return WorkerRecord(wid, hb, 0.0)


@pytest.mark.parametrize(
    ("profile", "pool", "expected"),
    [
        (None, None, (None, None)),
        ("", "", (None, None)),
        ("l4", None, (None, "l4")),
        (None, "team-a", ("team-a", None)),
        ("team-a/l4", None, ("team-a", "l4")),
        ("team-a/l4", "team-b", ("team-b", "l4")),  # the pool header wins over the prefix
        ("team-a/", None, ("team-a", None)),
        ("/l4", None, (None, "l4")),
    ],
)
def test_split_routing_headers(profile, pool, expected):
    assert split_routing_headers(profile, pool) == expected


def test_canonical_profile_blank_is_none_and_case_folds():
    assert canonical_profile(None, ["l4"], []) is None
    assert canonical_profile("  ", ["l4"], []) is None
    assert canonical_profile(" L4 ", ["l4"], []) == "l4"


def test_canonical_profile_without_configured_profiles_takes_anything():
    assert canonical_profile("H100", [], []) == "h100"


def test_canonical_profile_prefers_spot_when_only_spot_is_configured():
    assert canonical_profile("l4", ["l4-spot", "a100"], []) == "l4-spot"
    assert canonical_profile("l4", ["l4", "l4-spot"], []) == "l4"


def test_canonical_profile_accepts_a_live_unconfigured_profile():
    assert canonical_profile("t4", ["l4"], ["t4"]) == "t4"


def test_canonical_profile_refuses_an_unknown_profile_naming_the_configured_ones():
    with pytest.raises(SIEError) as exc_info:
        canonical_profile("T4", ["l4", "a100"], ["h100"])
    err = exc_info.value
    assert err.code == ErrorCode.INVALID_INPUT
    assert "'T4'" in err.message and "['l4', 'a100']" in err.message
    assert err.extra["configured_gpu_types"] == ["l4", "a100"]


def test_lane_served_matches_pool_bundle_and_profile_or_any():
    ws = [
        worker("w1", "l4", "default"),
        worker("w2", "a100", "gliner"),
        worker("w3", "l4", "x", pool="batch"),
    ]
    assert lane_served(ws, Lane("default", "l4", "default"))
    assert lane_served(ws, Lane("default", "any", "gliner"))
    assert lane_served(ws, Lane("default", "", "default"))
    assert lane_served(ws, Lane("batch", "l4", "x"))
    assert not lane_served(ws, Lane("batch", "l4", "default"))  # l4/default is up in another pool
    assert not lane_served(ws, Lane("default", "l4", "x"))
    assert not lane_served(ws, Lane("default", "a100", "default"))
    assert not lane_served(ws, Lane("default", "any", "other"))
    assert not lane_served([], Lane("default", "any", "default"))


def test_best_lane_prefers_a_lane_with_the_model_loaded():
    ws = [worker("w1", "l4", "default", depth=0), worker("w2", "a100", "default", depth=9, loaded=("m",))]
    assert best_lane("m", ["default"], "default", ws) == Lane("default", "a100", "default")


def test_best_lane_then_prefers_the_earlier_bundle():
    ws = [worker("w1", "l4", "second"), worker("w2", "l4", "first", depth=5)]
    assert best_lane("m", ["First", "second"], "p", ws) == Lane("p", "l4", "first")


def test_best_lane_then_prefers_the_shallower_mean_queue():
    ws = [
        worker("w1", "l4", "default", depth=10),
        worker("w2", "l4", "default", depth=0),  # l4 mean depth 5
        worker("w3", "a100", "default", depth=4),
    ]
    assert best_lane("m", ["default"], "default", ws) == Lane("default", "a100", "default")


def test_best_lane_breaks_ties_by_name_so_the_choice_is_stable():
    ws = [worker("w1", "t4", "default"), worker("w2", "a100", "default")]
    assert best_lane("m", ["default"], "default", ws) == Lane("default", "a100", "default")
    assert best_lane("m", ["default"], "default", list(reversed(ws))) == Lane("default", "a100", "default")


def test_best_lane_needs_a_candidate():
    with pytest.raises(ValueError):
        best_lane("m", ["default"], "default", [])


def test_provisioning_message_says_what_and_where():
    assert provisioning_message("m", None, None) == (
        "No ready worker for model 'm' on any machine profile in the cluster; capacity is being provisioned"
    )
    assert "machine profile 'l4' in pool 'team-a'" in provisioning_message("m", "l4", "team-a")
