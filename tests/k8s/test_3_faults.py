"""Pods killed under load (issue 32): 200 encodes from 4 threads through the gateway Service
with the public sie-sdk 0.10.1; partway through, one victim goes. Per victim: requests failed
(goal 0), wrong vectors (goal 0, checked against references taken before), longest request.
Between victims the cluster is back to every pod Ready."""

from __future__ import annotations

import pytest

from tests.k8s.support import Cluster, log, run_load

pytestmark = pytest.mark.k8s


def force_delete(cluster: Cluster, pod: str) -> None:
    cluster.kubectl("delete", "pod", pod, "--force", "--grace-period=0", "--wait=false")


def kill_container(cluster: Cluster, pod: str, container: str) -> None:
    """SIGKILL one container's process from the node (its pod and the other container stay)."""
    cluster.ctr("tasks", "kill", "-s", "SIGKILL", cluster.container_id(pod, container))


VICTIMS = {
    "worker pod": lambda c: force_delete(c, c.pod_names("worker")[0]),
    "one of two gateway pods": lambda c: force_delete(c, c.pod_names("gateway")[0]),
    "NATS pod": lambda c: force_delete(c, c.pod_names("nats")[0]),
    "config-service pod": lambda c: force_delete(c, c.pod_names("config")[0]),
    "sidecar container": lambda c: kill_container(c, c.pod_names("worker")[0], "sidecar"),
}


@pytest.mark.parametrize("victim", list(VICTIMS))
def test_victim_under_load_loses_nothing(cluster: Cluster, sdk, table, victim):
    cluster.wait_ready()
    if victim == "one of two gateway pods":
        assert len(cluster.pod_names("gateway")) == 2
    if victim == "sidecar container":
        pod = cluster.pod_names("worker")[0]
        before = cluster.restarts(pod, "sidecar")
        worker_before = cluster.restarts(pod, "worker")
    log(f"load with victim {victim}")
    res = run_load(cluster.gateway_url, lambda: VICTIMS[victim](cluster), total=200, threads=4)
    log(f"{victim}: {res.summary()} {res.errors}")
    assert res.acted_at is not None and res.spans(res.acted_at), "the kill did not fall mid-run"
    table.row(f"fault: {victim}", res.summary() + (f" {res.errors}" if res.errors else ""))
    assert len(res.results) == 200
    assert res.failed == 0 and res.wrong == 0, res.errors
    cluster.wait_ready()
    if victim == "sidecar container":
        # the kubelet restarted that container alone
        assert cluster.restarts(pod, "sidecar") == before + 1
        assert cluster.restarts(pod, "worker") == worker_before
