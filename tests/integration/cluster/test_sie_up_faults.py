"""Faults under load through ``sie up`` and the public sie-sdk 0.10.1 (issue 12).

Clients send encode requests from several threads for the whole run; a process is killed with
SIGKILL partway through and ``sie up``'s supervision restarts it. Per victim the run reports:
succeeded, failed, wrong results (vectors checked against references taken before the kill),
longest request, time from the kill to the first request started after it that succeeded, and
time from the kill until throughput (completions per second) is back to 90 % of its rate before.
The default run has one victim (the sidecar, ~30 s); the whole matrix is behind ``slow``:

    .venv/bin/python -m pytest -m slow -s tests/integration/cluster/test_sie_up_faults.py
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.support.sdk312 import run_sdk
from tests.support.sie_up import SieUp

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
LOAD = """
import concurrent.futures, time
import numpy as np
from sie_sdk import SIEClient

MODEL = "MODEL_ID"
TEXTS = [f"fault text {i}" for i in range(8)]
DURATION, THREADS = float(DURATION_S), 4
with SIEClient(URL) as c:
    refs = {t: np.asarray(c.encode(MODEL, {"text": t}, provision_timeout_s=120)["dense"]) for t in TEXTS}
    print("REFS", flush=True)
    t0 = time.time()

    def worker(k):
        out = []
        with SIEClient(URL) as cc:
            i = 0
            while time.time() - t0 < DURATION:
                text = TEXTS[(k + i) % len(TEXTS)]
                i += 1
                start = time.time()
                try:
                    r = cc.encode(MODEL, {"text": text}, provision_timeout_s=90)
                    v, ref = np.asarray(r["dense"]), refs[text]
                    # in bf16 (SIE_CPU_PRECISION=auto) another batch rounds differently: direction, not bits
                    ok = float(v @ ref) / float(np.linalg.norm(v) * np.linalg.norm(ref)) >= 0.9999
                    out.append((start, time.time(), "ok" if ok else "wrong"))
                except Exception as exc:
                    out.append((start, time.time(), f"error: {type(exc).__name__}: {exc}"[:200]))
        return out

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        results = [r for rs in pool.map(worker, range(THREADS)) for r in rs]
print(json.dumps({"results": results}))
"""


def run_victim(
    tmp_path,
    victim: str,
    *,
    duration_s: float = 20.0,
    kill_after_s: float = 6.0,
    model: str = "sie-fake",
    gateways: int = 1,
) -> dict:
    up = SieUp(tmp_path / "state", preload=model, gateways=gateways)
    try:
        up.start()
        killed: dict[str, float] = {}

        def kill() -> None:
            pid = up.children()[victim]["pid"]
            killed["at"] = time.time()
            os.kill(pid, signal.SIGKILL)

        # the clients start after taking references (a few seconds); the kill lands mid-run
        timer = threading.Timer(kill_after_s, kill)
        timer.start()
        try:
            script = LOAD.replace("DURATION_S", str(duration_s)).replace("MODEL_ID", model)
            out = run_sdk(script, up.gateway, timeout=duration_s + 200)
        finally:
            timer.cancel()
        assert "at" in killed, "the run ended before the kill"
        results = out["results"]
        after = [r for r in results if r[0] >= killed["at"] and r[2] == "ok"]
        report = {
            "victim": victim,
            "succeeded": sum(r[2] == "ok" for r in results),
            "failed": sum(r[2].startswith("error") for r in results),
            "wrong": sum(r[2] == "wrong" for r in results),
            "longest_s": round(max(r[1] - r[0] for r in results), 2),
            "first_success_after_kill_s": round(min(r[1] for r in after) - killed["at"], 2)
            if after
            else None,
            "throughput_before_per_s": round(rate_before(results, killed["at"]), 1),
            "throughput_back_to_90pct_s": recovery_s(results, killed["at"]),
            "restarts": up.children()[victim]["restarts"],
            "model_load_s": re.findall(
                r"loading \S+… done in ([0-9.]+) s", (up.state / "logs" / "worker.log").read_text()
            ),
            # the worker's own recovery: from the kill until the restarted process (imports,
            # model reload) serves IPC again; what the cluster adds is the longest request beyond it
            "worker_back_s": worker_back_s(up.state / "logs" / "worker.log", killed["at"], model),
            "errors": sorted({r[2] for r in results if r[2] != "ok"})[:5],
        }
        print("FAULT REPORT", report)
        return report
    finally:
        up.stop()


def worker_back_s(log_path, kill_at: float, model: str) -> float | None:
    """Seconds from ``kill_at`` until the restarted worker serves IPC with ``model`` loaded again
    (the later of the two log lines)."""
    import datetime

    seen: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        mark = (
            "ipc"
            if "IPC server listening" in line
            else "model"
            if f"loading {model}… done in" in line
            else None
        )
        if mark is None or mark in seen:
            continue
        stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if stamp > kill_at:
            seen[mark] = stamp
    if len(seen) < 2:
        return None
    return round(max(seen.values()) - kill_at, 2)


def rate_before(results: list, kill_at: float, window_s: float = 4.0) -> float:
    return sum(kill_at - window_s <= r[1] < kill_at and r[2] == "ok" for r in results) / window_s


def recovery_s(results: list, kill_at: float) -> float | None:
    """Seconds from the kill to the end of the first 1 s window with ≥ 90 % of the rate before."""
    target = 0.9 * rate_before(results, kill_at)
    end = max(r[1] for r in results)
    t = kill_at
    while t + 1.0 <= end:
        if sum(t <= r[1] < t + 1.0 and r[2] == "ok" for r in results) >= target:
            return round(t + 1.0 - kill_at, 2)
        t += 0.25
    return None


def check(report: dict) -> None:
    assert report["restarts"] == 1, report  # sie up's supervision brought the victim back
    assert report["failed"] == 0 and report["wrong"] == 0, report
    assert report["succeeded"] > 0 and report["first_success_after_kill_s"] is not None, report
    assert report["longest_s"] < 90, report  # generous: only "no hang"


def test_sidecar_killed_under_load_loses_nothing(tmp_path, sdk):
    check(run_victim(tmp_path, "sidecar"))


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker", "nats", "config", "gateway"])
def test_fault_matrix_under_load(tmp_path, sdk, victim):
    check(run_victim(tmp_path, victim, duration_s=30.0, kill_after_s=8.0))


@pytest.mark.slow
def test_one_of_two_gateway_replicas_killed_under_load(tmp_path, sdk):
    """Two gateways share the port, as a Service spreads its replicas: clients of the killed one
    reconnect to the other at once (the SDK retries a dropped connection)."""
    report = run_victim(tmp_path, "gateway", duration_s=30.0, kill_after_s=8.0, gateways=2)
    check(report)
    assert report["longest_s"] <= 5.0, report


@pytest.mark.slow
def test_worker_killed_under_load_with_a_real_model(tmp_path, sdk):
    """The longest request against the model's reload time (``model_load_s``: start, then reload)."""
    report = run_victim(tmp_path, "worker", duration_s=40.0, kill_after_s=15.0, model=MINILM)
    check(report)
    assert report["worker_back_s"] is not None, report
    assert report["longest_s"] <= report["worker_back_s"] + 3.0, report
