"""Helpers for tests that run the cluster shape (gateway, sidecar, worker) as processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx


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


@contextlib.contextmanager
def running(cluster) -> Iterator:
    """Start a ``deploy.launcher.Cluster`` with the test process's ``SIE_*`` settings kept out of
    its children, wait until the gateway sees its worker, and on the way out stop it and kill
    whatever a failed stop left behind."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SIE_")}
    started: list[subprocess.Popen] = []
    try:
        try:
            cluster.start(say=lambda *_: None)
        finally:
            started = [p for _, p in cluster.procs]
        wait_for_worker(cluster.gateway_url)
        yield cluster
    finally:
        started = started or [p for _, p in cluster.procs]
        with contextlib.suppress(Exception):
            cluster.stop()
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        os.environ.update(saved)
