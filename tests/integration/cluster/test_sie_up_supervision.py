"""``sie up`` as a supervisor (issue 12): kill -9 of a child under ``sie up`` restarts that child
(the others keep running), ``sie status`` counts the restart, and the cluster serves again."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.support.nats_server import free_port_run
from tests.support.sie_up import SDK, SieUp


def encode_until_ok(gateway: str, text: str, timeout: float = 120.0) -> httpx.Response:
    """What a retrying client does: retry transport errors and retryable statuses until a 200."""
    deadline = time.monotonic() + timeout  # generous: only guards against a hang
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = httpx.post(
                gateway + "/v1/encode/sie-fake", json={"items": [{"text": text}]}, headers=SDK, timeout=30
            )
            if r.status_code == 200:
                return r
            last = (r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise AssertionError(f"no 200 within {timeout} s: {last}")


@pytest.fixture
def sie_up(tmp_path):
    up = SieUp(tmp_path / "state")
    try:
        yield up.start()
    finally:
        print(up.stop())


def test_a_killed_worker_is_restarted_and_the_cluster_serves_again(sie_up):
    before = sie_up.children()
    assert set(before) == {"nats", "config", "worker", "sidecar", "gateway"}
    assert len(encode_until_ok(sie_up.gateway, "before").json()["items"][0]["dense"]["values"]) == 384
    os.kill(before["worker"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60  # generous: only guards against a hang
    while sie_up.children()["worker"]["restarts"] < 1:
        assert time.monotonic() < deadline, sie_up.children()
        time.sleep(0.1)
    after = sie_up.children()
    assert after["worker"]["pid"] != before["worker"]["pid"] and after["worker"]["last_exit"] == -9
    for name in ("nats", "config", "sidecar", "gateway"):  # the others kept running, untouched
        assert after[name]["pid"] == before[name]["pid"] and after[name]["restarts"] == 0
    assert len(encode_until_ok(sie_up.gateway, "after").json()["items"][0]["dense"]["values"]) == 384
    rc, out = sie_up.status_command()
    assert rc == 0, out
    worker_row = next(line for line in out.splitlines() if line.startswith("worker"))
    assert worker_row.split()[1:5] == ["running", str(after["worker"]["pid"]), "1", "-9"], out
    assert sie_up.proc.poll() is None  # sie up itself kept running
    assert "worker exited with -9" in sie_up.stop()


def _free_port_pair() -> int:
    """A free port whose next port is free too (one metrics port per worker pod)."""
    return free_port_run(2)


def _batches(metrics_port: int) -> float:
    """RunBatch calls of one pod's sidecar for sie-fake, from its /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sie_sidecar_batch_size_count{") and "sie-fake" in line
    )


def _live_workers(gateway: str) -> list[str]:
    body = httpx.get(gateway + "/health", timeout=5).json()
    return sorted(w["url"] for w in body["workers"] if w["healthy"])


def test_two_worker_pods_share_the_lane_and_one_serves_while_the_other_restarts(tmp_path):
    """``sie up --workers 2``: two worker pods (worker + sidecar each, own socket, worker id and
    metrics port) pull from the one lane, both take batches; kill -9 of one pod's worker restarts
    that worker only, and requests keep being answered meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    port = _free_port_pair()
    up = SieUp(tmp_path / "state", workers=2, metrics_port=port)
    try:
        up.start()
        rows = up.children()
        assert set(rows) == {"nats", "config", "worker", "sidecar", "worker-2", "sidecar-2", "gateway"}
        deadline = time.monotonic() + 60  # generous: only guards against a hang
        while len(_live_workers(up.gateway)) < 2:
            assert time.monotonic() < deadline, httpx.get(up.gateway + "/health").text
            time.sleep(0.2)
        assert [w.rsplit("-", 1)[1] for w in _live_workers(up.gateway)] == ["0", "1"]
        assert (tmp_path / "state" / "ipc-2.sock").exists()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: encode_until_ok(up.gateway, f"pod {i}"), range(96)))
        assert all(len(a.json()["items"][0]["dense"]["values"]) == 384 for a in answers)
        first, second = _batches(port), _batches(port + 1)
        assert first > 0 and second > 0, (first, second)
        os.kill(rows["worker-2"]["pid"], signal.SIGKILL)
        with ThreadPoolExecutor(8) as pool:  # answered while worker-2 is down and coming back
            answers = list(pool.map(lambda i: encode_until_ok(up.gateway, f"during {i}"), range(32)))
        assert all(a.status_code == 200 for a in answers)
        deadline = time.monotonic() + 60
        while up.children()["worker-2"]["restarts"] < 1:
            assert time.monotonic() < deadline, up.children()
            time.sleep(0.1)
        after = up.children()
        for name in ("nats", "config", "worker", "sidecar", "sidecar-2", "gateway"):
            assert after[name]["pid"] == rows[name]["pid"] and after[name]["restarts"] == 0, name
        assert encode_until_ok(up.gateway, "after").status_code == 200
    finally:
        said = up.stop()
    # stopped in reverse start order: the gateway, the sidecars, then the workers
    order = [
        said.index(f"stopping {name} (pid")
        for name in ("gateway", "sidecar-2", "sidecar", "worker-2", "worker", "config", "nats")
    ]
    assert order == sorted(order), said
