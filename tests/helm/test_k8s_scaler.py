"""gateway.k8s_scaler against recorded Kubernetes API responses, through the real kubernetes client."""

from __future__ import annotations

import asyncio
import logging

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402

from gateway.k8s_scaler import K8sScaler, K8sScalerSettings, Lane, build_scaler, parse_targets  # noqa: E402
from tests.helm.k8s_api_server import RecordedApi  # noqa: E402

NS = "sie"
BASE = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
TARGETS = "default:l4:default=sie-w-default-l4,default:cpu:default=sie-w-default-cpu,batch:l4:default=sie-w-batch-l4"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorded():
    api = RecordedApi().start()
    api.route("GET", f"{BASE}/sie-w-default-l4/scale", 200, "read-scale-zero.json")
    api.route("PATCH", f"{BASE}/sie-w-default-l4/scale", 200, "patch-scale-one.json")
    api.route("GET", f"{BASE}/sie-w-default-cpu/scale", 200, "read-scale-two.json")
    yield api
    api.stop()


def apps_api(url: str) -> client.AppsV1Api:
    cfg = client.Configuration()
    cfg.host = url
    cfg.api_key = {"authorization": "recorded-sa-token"}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return client.AppsV1Api(client.ApiClient(cfg))


def scaler(recorded: RecordedApi, clock: Clock | None = None, **kw) -> K8sScaler:
    return K8sScaler(
        api=apps_api(recorded.url), namespace=NS, targets=parse_targets(TARGETS), clock=clock or Clock(), **kw
    )


def test_parse_targets():
    t = parse_targets(TARGETS)
    assert t[Lane("default", "l4", "default")] == "sie-w-default-l4"
    assert len(t) == 3
    assert parse_targets(" a:B:c = x ,") == {Lane("a", "b", "c"): "x"}
    for bad in ("a:b=x", "a:b:c", "a:b:c=", ":b:c=x"):
        with pytest.raises(ValueError):
            parse_targets(bad)


def test_wakes_statefulset_at_zero(recorded):
    s = scaler(recorded)
    events = s.reconcile([Lane("default", "l4", "default")], served=lambda lane: False)
    # l4/default has a StatefulSet in two pools; only the pool with the demand is read and woken
    assert [(e.statefulset, e.from_replicas, e.to_replicas) for e in events] == [("sie-w-default-l4", 0, 1)]
    calls = [(r.method, r.path) for r in recorded.requests]
    assert calls == [("GET", f"{BASE}/sie-w-default-l4/scale"), ("PATCH", f"{BASE}/sie-w-default-l4/scale")]
    patches = [r for r in recorded.requests if r.method == "PATCH"]
    assert len(patches) == 1
    assert patches[0].path == f"{BASE}/sie-w-default-l4/scale"
    assert patches[0].body == {"spec": {"replicas": 1}}
    assert "patch" in patches[0].headers["content-type"]
    assert patches[0].headers["authorization"] == "Bearer recorded-sa-token"


def test_demand_in_one_pool_wakes_that_pool_only(recorded):
    recorded.route("GET", f"{BASE}/sie-w-batch-l4/scale", 200, "read-scale-zero.json")
    recorded.route("PATCH", f"{BASE}/sie-w-batch-l4/scale", 200, "patch-scale-one.json")
    served = {Lane("default", "l4", "default")}  # the default pool's l4 workers are up
    events = scaler(recorded).reconcile(
        [Lane("batch", "l4", "default"), Lane("default", "l4", "default")], served=lambda lane: lane in served
    )
    assert [e.statefulset for e in events] == ["sie-w-batch-l4"]
    assert {r.path for r in recorded.requests} == {f"{BASE}/sie-w-batch-l4/scale"}


def test_demand_that_named_no_profile_wakes_the_first_target_of_its_pool(recorded):
    events = scaler(recorded).reconcile([Lane("default", "any", "default")], served=lambda lane: False)
    assert [e.statefulset for e in events] == ["sie-w-default-l4"]  # first in the configured order
    assert {r.path for r in recorded.requests} == {f"{BASE}/sie-w-default-l4/scale"}


def test_running_statefulset_is_left_alone(recorded):
    events = scaler(recorded).reconcile([Lane("default", "cpu", "default")], served=lambda lane: False)
    assert events == []
    assert [(r.method, r.path) for r in recorded.requests] == [("GET", f"{BASE}/sie-w-default-cpu/scale")]


def test_served_lane_makes_no_api_call(recorded):
    assert scaler(recorded).reconcile([Lane("default", "l4", "default")], served=lambda lane: True) == []
    assert recorded.requests == []


def test_unknown_lane_makes_no_api_call(recorded):
    unknown = Lane("default", "a100-80gb", "default")
    assert scaler(recorded).reconcile([unknown], served=lambda lane: False) == []
    assert recorded.requests == []


def test_recheck_window_limits_reads(recorded):
    clock = Clock()
    s = scaler(recorded, clock, recheck_s=15.0)
    s.wake("cpu", "default")
    s.wake("cpu", "default")
    assert len(recorded.requests) == 1
    clock.now += 16
    s.wake("cpu", "default")
    assert len(recorded.requests) == 2


def test_forbidden_patch_is_logged_and_retried(recorded, caplog):
    recorded.route("PATCH", f"{BASE}/sie-w-default-l4/scale", 403, "forbidden.json")
    clock = Clock()
    s = scaler(recorded, clock, recheck_s=15.0)
    with caplog.at_level(logging.WARNING, logger="gateway.k8s_scaler"):
        assert s.wake("l4", "default", pool="default") == []
    assert "Forbidden" in caplog.text
    # a failed attempt does not start the recheck window: the next pass tries again
    recorded.route("PATCH", f"{BASE}/sie-w-default-l4/scale", 200, "patch-scale-one.json")
    events = s.wake("l4", "default", pool="default")
    assert [e.statefulset for e in events] == ["sie-w-default-l4"]
    assert [r.method for r in recorded.requests] == ["GET", "PATCH", "GET", "PATCH"]


async def test_async_run_loop(recorded):
    s = scaler(recorded)
    task = asyncio.create_task(
        s.run(lambda: [Lane("default", "l4", "default")], lambda lane: False, interval_s=0.01)
    )
    for _ in range(200):
        if s.events:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [e.statefulset for e in s.events] == ["sie-w-default-l4"]


def test_settings_from_env(monkeypatch, recorded):
    monkeypatch.setenv("SIE_GATEWAY_K8S_SCALER_ENABLED", "true")
    monkeypatch.setenv("SIE_GATEWAY_K8S_NAMESPACE", NS)
    monkeypatch.setenv("SIE_GATEWAY_K8S_SCALER_TARGETS", TARGETS)
    monkeypatch.setenv("SIE_GATEWAY_K8S_SCALER_INTERVAL_S", "2.5")
    settings = K8sScalerSettings()
    assert settings.scaler_interval_s == 2.5
    built = build_scaler(settings, api=apps_api(recorded.url))
    assert built is not None and built.namespace == NS and len(built.targets) == 3
    monkeypatch.setenv("SIE_GATEWAY_K8S_SCALER_ENABLED", "false")
    assert build_scaler(K8sScalerSettings()) is None
    monkeypatch.setenv("SIE_GATEWAY_K8S_SCALER_TARGETS", "nonsense")
    with pytest.raises(ValueError):
        K8sScalerSettings()
