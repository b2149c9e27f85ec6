"""A real cluster shape for contract checks: ``deploy.launcher.Cluster`` (nats-server, config
service on SQLite, worker IPC server, sidecar, gateway — all subprocesses), plus extra gateway
processes with their own settings (short deadline, tiny queue, auth) on the same NATS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from deploy.launcher import Tokens
from tests.support.cluster import OpenCluster, free_cluster_ports, running, wait_for_worker
from tests.support.nats_server import free_port

ADMIN = "cluster-admin-token"  # the config service's admin token (model config writes)
POOL_ADMIN = "cluster-pool-admin-token"  # the gateways' admin token (pool writes)
CONFIG_READ = "cluster-config-read-token"  # what gateways and sidecars read the config service with
FAKE = "sie-fake"


class TestCluster(OpenCluster):
    """The launcher's cluster with two configured machine profiles: ``cpu`` (a worker) and ``l4`` (none)."""

    __test__ = False
    settings: ClassVar[dict[str, str]] = {
        "SIE_GATEWAY_CONFIGURED_GPUS": "cpu,l4",
        "SIE_GATEWAY_PROVISIONING_RETRY_AFTER_S": "2",
        "SIE_CONFIG_POLL_INTERVAL_S": "2",
        "SIE_HEALTH_PUBLISH_INTERVAL_MS": "1000",
        "SIE_STREAM_STORAGE": "memory",
        "SIE_RESULT_CACHE_ENABLED": "true",  # the contract holds with the cache on
    }

    def tokens(self) -> Tokens:
        return Tokens(admin=ADMIN, config_read=CONFIG_READ, pool_admin=POOL_ADMIN)

    def spawn_gateway(self, name: str, token: str | None = None, **env: str) -> str:
        """Another gateway process on this cluster's NATS and config service, once it sees a
        worker; returns its URL."""
        port = free_port()
        extra = {"SIE_GATEWAY_HOST": "127.0.0.1", "SIE_GATEWAY_PORT": str(port), **env}
        self._spawn(name, [sys.executable, "-m", "gateway"], extra)
        url = f"http://127.0.0.1:{port}"
        self._wait(name, lambda: _ok(url + "/readyz"), 60)
        wait_for_worker(url, headers={"Authorization": f"Bearer {token}"} if token else None)
        return url


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = Path(tmp_path_factory.mktemp("cluster"))
    with running(TestCluster(state_dir=state, **free_cluster_ports(), preload=FAKE)) as c:
        yield c


def spawn_pair(c: TestCluster, name: str, profile: str) -> list[subprocess.Popen]:
    """A second worker + sidecar of machine profile ``profile`` (capacity arriving)."""
    sock = c.state_dir / f"{name}.sock"
    env = {
        "SIE_IPC_SOCKET_PATH": str(sock),
        "SIE_WORKER_ID": f"{name}-0",
        "SIE_MACHINE_PROFILE": profile,
        "SIE_PRELOAD_MODELS": FAKE,
    }
    worker = c._spawn(f"{name}-worker", [sys.executable, "-m", "worker.ipc"], env)
    c._wait(f"{name}-worker", sock.exists, 120)
    sidecar = c._spawn(f"{name}-sidecar", [sys.executable, "-m", "sidecar"], env)
    return [worker, sidecar]
