"""Pure gateway logic: response splicing, failure aggregation, heartbeat registry, demand, settings."""

from __future__ import annotations

import pytest

from gateway import responses
from gateway.metrics import DemandTracker, GatewayMetrics
from gateway.routing import Lane
from gateway.settings import GatewaySettings
from gateway.workers import WorkerRegistry
from protocol.codec import packb, unpackb
from protocol.errors import SIEError
from protocol.work import Heartbeat, WorkResult


def ok(i: int, blob: bytes) -> WorkResult:
    return WorkResult(f"r.{i}", "r", i, True, result_msgpack=blob)


def bad(i: int, code: str, retry: float | None = None) -> WorkResult:
    return WorkResult(f"r.{i}", "r", i, False, error=f"e{i}", error_code=code, retry_after_s=retry)


def test_score_splice_keeps_worker_entries_and_adds_model():
    blob = packb({"scores": [{"item_id": "a", "score": 1.0, "rank": 0}], "query_id": "q"})
    out = unpackb(responses.score_msgpack("m", ok(0, blob), {"total_ms": 1.0}))
    assert out["model"] == "m" and out["query_id"] == "q" and out["scores"][0]["item_id"] == "a"
    # a bare list of entries is wrapped
    out = unpackb(responses.score_msgpack("m", ok(0, packb([{"item_id": "a"}])), {}))
    assert out["scores"] == [{"item_id": "a"}]
    # big maps (map16 header) splice too
    big = packb({f"k{i}": i for i in range(20)})
    assert len(unpackb(responses.score_msgpack("m", ok(0, big), {}))) == 23  # + model, timing, usage


def test_usage_totals_the_truncation_the_workers_reported():
    a = WorkResult(
        "r.0", "r", 0, True, result_msgpack=packb({}), input_tokens=10, truncated_items=1, dropped_tokens=40
    )
    b = WorkResult("r.1", "r", 1, True, result_msgpack=packb({}), input_tokens=5)
    out = unpackb(responses.items_msgpack("m", [a, b], {}))
    assert out["usage"] == {"input_tokens": 15, "truncated_items": 1, "dropped_tokens": 40}
    assert responses.items_json("m", [a, b], {})["usage"] == out["usage"]
    assert unpackb(responses.score_msgpack("m", a, {}))["usage"]["dropped_tokens"] == 40
    assert "input_tokens" not in responses.usage([WorkResult("r.0", "r", 0, True)])  # not counted: left out


def test_items_msgpack_orders_and_marks_item_errors():
    results = [ok(0, packb({"id": "a"})), bad(1, "INVALID_INPUT")]
    out = unpackb(responses.items_msgpack("m", results, {}, {1}))
    assert out["items"][0] == {"id": "a"} and out["items"][1]["error"]["code"] == "INVALID_INPUT"


def test_failure_aggregation():
    with pytest.raises(SIEError) as e:
        responses.check_failures([ok(0, b"\x80"), bad(1, "RESOURCE_EXHAUSTED", 7)])
    assert e.value.status == 503 and e.value.retry_after == 7
    with pytest.raises(SIEError) as e:
        responses.check_failures([bad(0, "INPUT_TOO_LONG"), bad(1, "INPUT_TOO_LONG")])
    assert e.value.status == 400 and e.value.code == "INPUT_TOO_LONG"
    with pytest.raises(SIEError) as e:
        responses.check_failures([bad(0, "INPUT_TOO_LONG"), bad(1, "INFERENCE_ERROR")])
    assert e.value.status == 500 and len(e.value.extra["details"]) == 2
    with pytest.raises(SIEError) as e:
        responses.check_failures([bad(0, "MODEL_LOAD_FAILED")])
    assert e.value.status == 502 and e.value.retry_after is None
    assert responses.check_failures([ok(0, b"\x80"), bad(1, "INVALID_INPUT")], allow_item_errors=True) == {1}


def test_worker_registry_staleness_and_tombstone():
    now = [100.0]
    reg = WorkerRegistry(stale_after_s=15, clock=lambda: now[0])
    hb = Heartbeat(name="w", ready=True, machine_profile="L4", pool_name="default", bundle="default")
    reg.observe("w", hb.to_json())
    assert [w.profile for w in reg.healthy()] == ["l4"]
    now[0] += 16
    assert reg.healthy() == []
    reg.observe("w", hb.to_json())
    hb.terminated = True
    reg.observe("w", hb.to_json())
    assert reg.all() == []
    assert reg.observe("x", b"\xff not a heartbeat") is None


def test_worker_registry_generation_moves_with_every_change_and_staleness_is_foreseen():
    now = [100.0]
    reg = WorkerRegistry(stale_after_s=15, clock=lambda: now[0])
    hb = Heartbeat(name="w", ready=True, machine_profile="cpu", pool_name="default", bundle="default")
    seen = [reg.generation]
    reg.observe("w", hb.to_json())
    now[0] += 5
    reg.observe("v", hb.to_json())
    seen.append(reg.generation)
    assert reg.healthy_until(reg.healthy()) == 100.0 + 15  # w's heartbeat is the older
    reg.healthy()  # reading changes nothing
    assert reg.generation == seen[-1]
    reg.remove("v")
    seen.append(reg.generation)
    now[0] += 1000
    reg.prune()
    seen.append(reg.generation)
    assert reg.all() == [] and len(set(seen)) == len(seen)


def test_demand_expires_and_clears():
    now = [0.0]
    m = GatewayMetrics()
    d = DemandTracker(m, expiry_s=120, clock=lambda: now[0])
    d.record("L4", "default")
    assert b'sie_gateway_pending_demand{bundle="default",machine_profile="l4"} 1.0' in m.render()
    assert list(d.pending()) == [Lane("default", "l4", "default")]
    now[0] = 121
    d.refresh()
    assert b'sie_gateway_pending_demand{bundle="default",machine_profile="l4"} 0.0' in m.render()
    assert d.pending() == {}


def test_demand_is_kept_per_pool_and_the_gauge_per_profile_and_bundle():
    m = GatewayMetrics()
    d = DemandTracker(m, expiry_s=120, clock=lambda: 0.0)
    d.record("l4", "default", "batch")
    d.record("l4", "default", "default")
    d.refresh(lambda lane: lane.pool == "default")  # the default pool's workers came up
    assert list(d.pending()) == [Lane("batch", "l4", "default")]
    assert b'sie_gateway_pending_demand{bundle="default",machine_profile="l4"} 1.0' in m.render()
    d.clear("l4", "default")  # every pool
    assert d.pending() == {}
    assert b'sie_gateway_pending_demand{bundle="default",machine_profile="l4"} 0.0' in m.render()


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("SIE_GATEWAY_CONFIGURED_GPUS", "L4, a100-80gb")
    monkeypatch.setenv("SIE_AUTH_MODE", "token")
    monkeypatch.setenv("SIE_AUTH_TOKENS", "a,b")
    s = GatewaySettings()
    assert (
        s.configured_gpus() == ["l4", "a100-80gb"] and s.auth_enabled and s.inference_tokens() == ["a", "b"]
    )
    assert s.gateway_request_timeout_s < 150 and s.gateway_port == 8080
    monkeypatch.setenv("SIE_AUTH_MODE", "bogus")
    with pytest.raises(ValueError):
        GatewaySettings()


def test_a_lane_has_its_leaders_only_when_their_answers_name_them():
    """A member restarted after a kill -9 answers a durable's info before it rejoins the durable's
    group: the config and no cluster part, or a cluster part without a leader. That is not the
    leader's answer; the lane stays on the direct path until the answers name a leader."""
    from nats.js.api import ClusterInfo, ConsumerConfig, ConsumerInfo

    from gateway.direct import has_leader

    def info(cluster):
        return ConsumerInfo(
            name="d", stream_name="s", config=ConsumerConfig(durable_name="d"), created=0, cluster=cluster
        )

    assert not has_leader(info(None))
    assert not has_leader(info(ClusterInfo(leader="")))
    assert has_leader(info(ClusterInfo(leader="nats-2")))
