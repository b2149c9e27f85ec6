"""``sie up --gateways N``: the replicas share one port, so the launcher cannot ask a given replica
whether it is ready; a ready replica would answer for one still warming up (which has heard no
worker heartbeat yet and answers PROVISIONING). Each ready ``/readyz`` names the process that
answered, and the launcher waits for every replica's own."""

from __future__ import annotations

import urllib.request

from deploy.launcher import Cluster
from iokit.http import READY_PID_HEADER
from tests.support.cluster import free_cluster_ports


def test_every_gateway_replica_is_ready_when_the_cluster_says_it_is_up(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_HEALTH_PUBLISH_INTERVAL_MS", "1000")
    monkeypatch.setenv("SIE_TORCH_THREADS", "1")
    cluster = Cluster(
        state_dir=tmp_path / "state",
        **free_cluster_ports(),
        preload="sie-fake",
        gateways=2,
    )
    try:
        cluster.start(say=lambda line: None)
        pids = {proc.pid for name, proc in cluster.procs if name.startswith("gateway")}
        assert len(pids) == 2
        answered = set()
        for _ in range(60):  # a new connection each time: the kernel spreads them over the replicas
            with urllib.request.urlopen(cluster.gateway_url + "/readyz", timeout=5) as resp:  # 503 raises
                answered.add(int(resp.headers[READY_PID_HEADER]))
        assert answered == pids
    finally:
        cluster.stop()
