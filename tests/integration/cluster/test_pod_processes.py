"""A worker pod of several model processes (``sie up --model-processes 2``, the chart's GPU pods):
each worker process has a sidecar of its own and serves as a worker of its own; process 0 of each
container restarts a killed sibling while the others serve, loses no request, and takes its
siblings along when it stops."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.cluster.test_sie_up_faults import LOAD
from tests.support.polling import wait_until
from tests.support.processes import alive, children
from tests.support.sdk312 import run_sdk
from tests.support.sie_up import SieUp


def healthy_workers(gateway: str) -> set[str]:
    body = httpx.get(gateway + "/health", timeout=5).json()
    return {w["url"].removeprefix("nats:") for w in body["workers"] if w["healthy"]}


def wait_for(check, what: str):
    """:func:`tests.support.polling.wait_until` from this synchronous test (60 s: only against a hang)."""
    return asyncio.run(wait_until(check, 60.0, interval_s=0.2, what=what))


@pytest.mark.parametrize("victim", ["worker", "sidecar"])
def test_a_killed_sibling_is_restarted_and_loses_nothing(tmp_path, sdk, victim):  # noqa: F811
    up = SieUp(tmp_path / "state", model_processes=2).start()
    try:
        ids = wait_for(lambda: (ws := healthy_workers(up.gateway)) and len(ws) == 2 and ws, what="2 workers")
        assert sorted(ids, key=len)[1] == sorted(ids, key=len)[0] + "-p1"  # <pod>, <pod>-p1
        assert (up.state / "ipc.sock").is_socket() and (up.state / "ipc.p1.sock").is_socket()
        # two workers, one device: /health counts the pod's device once
        assert httpx.get(up.gateway + "/health", timeout=5).json()["cluster"]["gpu_count"] == 1
        first = up.children()[victim]["pid"]
        [sibling] = children(first)
        killed: dict[str, float] = {}

        def kill() -> None:
            killed["at"] = time.time()
            os.kill(sibling, signal.SIGKILL)

        timer = threading.Timer(6.0, kill)  # mid-run: the clients take their references first
        timer.start()
        try:
            out = run_sdk(
                LOAD.replace("DURATION_S", "16").replace("MODEL_ID", "sie-fake"), up.gateway, timeout=220
            )
        finally:
            timer.cancel()
        assert "at" in killed, "the run ended before the kill"
        results = out["results"]
        errors = sorted({r[2] for r in results if r[2] != "ok"})
        assert not errors, errors[:5]
        assert sum(r[0] >= killed["at"] for r in results) > 0  # requests ran after the kill, all served
        # process 0 restarted its sibling, which serves again as the same worker
        [again] = wait_for(lambda: [p for p in children(first) if p != sibling], what="a new sibling")
        assert (
            alive(again) and up.children()[victim]["pid"] == first and up.children()[victim]["restarts"] == 0
        )
        wait_for(lambda: healthy_workers(up.gateway) == ids, what="both workers healthy again")
    finally:
        up.stop()


def test_siblings_stop_with_the_pod(tmp_path):
    up = SieUp(tmp_path / "state", model_processes=2).start()
    try:
        pids = {name: up.children()[name]["pid"] for name in ("worker", "sidecar")}
        siblings = [s for pid in pids.values() for s in children(pid)]
        assert len(siblings) == 2 and all(map(alive, siblings))
    finally:
        up.stop()
    assert not any(map(alive, siblings)), "a sibling outlived sie up"
