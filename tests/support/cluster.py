"""Helpers for tests that run the cluster shape (gateway, sidecar, worker) as processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import ClassVar

import httpx

from deploy.launcher import Cluster
from tests.support.nats_server import free_port


def wait_for_worker(
    url: str, timeout: float = 240.0, headers: dict[str, str] | None = None, profile: str = "cpu"
) -> dict:
    """Until the gateway at ``url`` sees a live worker of ``profile`` (other profiles do not count)."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            body = httpx.get(url + "/health", timeout=2, headers=headers).json()
            if profile in body.get("live_gpu_types", []):
                return body
        time.sleep(0.2)
    raise AssertionError(f"no live {profile} worker seen by {url}: {body}")


def free_cluster_ports() -> dict[str, int]:
    """Free ports for a ``deploy.launcher.Cluster``'s gateway, config service and nats-server."""
    return {"gateway_port": free_port(), "config_port": free_port(), "nats_port": free_port()}


def _log(cluster, name: str) -> str:
    """The end of a cluster child's log ("" before it has one)."""
    path = cluster.state_dir / "logs" / f"{name}.log"
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


class OpenCluster(Cluster):
    """The launcher's cluster with no auth between its processes, and ``settings`` (of the
    subclass) in every child's environment."""

    __test__ = False
    settings: ClassVar[dict[str, str]] = {}

    def env(self) -> dict[str, str]:
        return {**{k: v for k, v in super().env().items() if not k.startswith("SIE_AUTH")}, **self.settings}

    def log(self, name: str) -> str:
        return _log(self, name)


@contextlib.contextmanager
def running(cluster, env: dict[str, str] | None = None) -> Iterator:
    """Start a ``deploy.launcher.Cluster`` with the test process's ``SIE_*`` settings kept out of
    its children (``env``: the settings they get instead), wait until the gateway sees its worker,
    and on the way out stop it and kill whatever a failed stop left behind. What went wrong is
    printed: every child's log when the start fails, and the log of a child that died meanwhile."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SIE_")}
    os.environ.update(env or {})
    started: list[subprocess.Popen] = []
    try:
        try:
            cluster.start(say=lambda *_: None)
            wait_for_worker(cluster.gateway_url)
        except Exception:
            for name, _ in cluster.procs:
                print(f"---- {name} ----\n{_log(cluster, name)}")
            raise
        finally:
            started = [p for _, p in cluster.procs]
        yield cluster
    finally:
        started = started or [p for _, p in cluster.procs]
        for name, child in cluster.supervisor.children.items():
            if child.proc is None or child.proc.poll() is not None:
                code = child.proc.returncode if child.proc is not None else "unknown"
                print(f"---- {name} exited early ({code}) ----\n{_log(cluster, name)}")
        with contextlib.suppress(Exception):
            cluster.stop()
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for k in [k for k in os.environ if k.startswith("SIE_")]:
            del os.environ[k]
        os.environ.update(saved)
