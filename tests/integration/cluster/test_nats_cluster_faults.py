"""Faults of a three-member NATS JetStream cluster under load (issue 35), through ``sie up
--nats-replicas 3`` and the public sie-sdk 0.10.1, as tests/integration/cluster/test_sie_up_faults.py
does for single processes.

Cases: kill -9 of a member that does not lead the work stream; kill -9 of the member that leads
the work stream (``WORK_POOL_default``), or the lane's interactive durable (both read from the
members' ``/jsz``); kill -9 of the member the sidecar is connected to; SIGSTOP for 30 s, then
SIGCONT, of the member the gateway is connected to (both read from ``/connz``). Per case the run
reports requests succeeded, failed and wrong (vectors checked against references taken before the
fault), the longest request, and the time from the fault until throughput is back to 90 % of its
rate before it.

    make test-ha     # marker ``ha``: CI runs it after ``make test``, which leaves it out

The five-minute soak in ``make test`` restarts NATS members under load too; these cases give each
fault its own run and its recovery figures.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.cluster.test_sie_up_faults import LOAD, rate_before, recovery_s
from tests.support.polling import wait_until
from tests.support.sdk312 import run_sdk
from tests.support.sie_up import SieUp

pytestmark = pytest.mark.ha

STREAM = "WORK_POOL_default"
DURABLE = "default_cpu_default"  # the interactive durable of the default lane


def stream_leader(up: SieUp, stream: str = STREAM) -> str | None:
    """The member (``nats``, ``nats-2``, ``nats-3``) leading ``stream``, as a member that answers says."""
    return leaders(up, stream).get("stream") or None


def leaders(up: SieUp, stream: str = STREAM) -> dict[str, str]:
    """Who leads what the requests need, as the first member that knows the stream's leader says:
    JetStream's meta group (``meta``), the work stream (``stream``) and each of its consumers (by
    durable name); empty when no member answers with a leader of the stream."""
    for port in up.nats_monitor_ports:
        try:
            doc = httpx.get(
                f"http://127.0.0.1:{port}/jsz?accounts=true&streams=true&consumers=true", timeout=2
            ).json()
        except (httpx.HTTPError, ValueError):
            continue
        found = {"meta": str((doc.get("meta_cluster") or {}).get("leader") or "")}
        for account in doc.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") != stream:
                    continue
                found["stream"] = str((detail.get("cluster") or {}).get("leader") or "")
                for consumer in detail.get("consumer_detail") or []:
                    found[str(consumer.get("name"))] = str(
                        (consumer.get("cluster") or {}).get("leader") or ""
                    )
        if found.get("stream"):
            return found
    return {}


def member_serving(up: SieUp, client: str) -> str | None:
    """The member (``nats``, ``nats-2``, ``nats-3``) a client whose name starts with ``client`` is
    connected to."""
    for i, port in enumerate(up.nats_monitor_ports):
        try:
            doc = httpx.get(f"http://127.0.0.1:{port}/connz", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            continue
        if any(str(c.get("name", "")).startswith(client) for c in doc.get("connections") or []):
            return "nats" if i == 0 else f"nats-{i + 1}"
    return None


def direct_items(up: SieUp) -> float:
    """Items the gateway sent on the direct path (``sie_gateway_queue_direct_items_total``)."""
    text = httpx.get(up.gateway + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sie_gateway_queue_direct_items_total{")
    )


def run_case(tmp_path, case: str, *, duration_s: float = 30.0, fault_after_s: float = 8.0) -> dict:
    up = SieUp(tmp_path / "state", nats_replicas=3)
    try:
        up.start()
        leader = asyncio.run(wait_until(lambda: stream_leader(up), 60, what="a leader of the work stream"))
        gateway_member = asyncio.run(
            wait_until(lambda: member_serving(up, "sie-gateway"), 60, what="the gateway's member")
        )
        sidecar_member = asyncio.run(
            wait_until(lambda: member_serving(up, "sie-sidecar-"), 60, what="the sidecar's member")
        )
        led = leaders(up)  # what the victim leads besides the stream: printed in the report
        victim = {
            "member": "nats-3" if leader != "nats-3" else "nats-2",
            "leader": leader,
            # the member the gateway is connected to: it keeps the connection open while stopped, so
            # the gateway learns it is gone only from unanswered pings (protocol/nats_url.py)
            "stop": gateway_member,
            # the member the sidecar pulls through: what it was delivering on the killed
            # connection is lost, and JetStream sends it again when its ack wait (3 s) runs out
            "sidecar": sidecar_member,
            "durable": led.get(DURABLE, ""),  # the member leading the lane's interactive durable
        }[case]
        fault: dict[str, float] = {}

        def act() -> None:
            pid = up.children()[victim]["pid"]
            fault["at"] = time.time()
            if case == "stop":
                os.kill(pid, signal.SIGSTOP)
                time.sleep(30)  # the fault itself lasts 30 s
                os.kill(pid, signal.SIGCONT)
            else:
                os.kill(pid, signal.SIGKILL)

        timer = threading.Timer(fault_after_s, act)
        timer.start()
        try:
            script = LOAD.replace("DURATION_S", str(duration_s)).replace("MODEL_ID", "sie-fake")
            out = run_sdk(script, up.gateway, timeout=duration_s + 200)
        finally:
            timer.join()
        results = out["results"]
        report = {
            "direct_items": direct_items(up),
            "case": case,
            "victim": victim,
            "stream_leader_before": leader,
            "gateway_member": gateway_member,
            "sidecar_member": sidecar_member,
            "victim_leads": sorted(k for k, v in led.items() if v == victim),
            "stream_leader_after": stream_leader(up),
            "succeeded": sum(r[2] == "ok" for r in results),
            "failed": sum(r[2].startswith("error") for r in results),
            "wrong": sum(r[2] == "wrong" for r in results),
            "longest_s": round(max(r[1] - r[0] for r in results), 2),
            "throughput_before_per_s": round(rate_before(results, fault["at"]), 1),
            "throughput_back_to_90pct_s": recovery_s(results, fault["at"]),
            "errors": sorted({r[2] for r in results if r[2] != "ok"})[:5],
            # requests completed per half second, from 1 s before the fault to 15 s after
            "completed_per_half_s": [
                sum(fault["at"] + t / 2 <= r[1] < fault["at"] + (t + 1) / 2 for r in results)
                for t in range(-2, 30)
            ],
        }
        print("NATS FAULT REPORT", report)
        return report
    finally:
        up.stop()


def check(report: dict) -> None:
    assert report["failed"] == 0 and report["wrong"] == 0, report
    assert report["succeeded"] > 0 and report["throughput_back_to_90pct_s"] is not None, report


def test_a_member_killed_under_load_loses_nothing(tmp_path, sdk):
    check(run_case(tmp_path, "member"))


@pytest.mark.parametrize("case", ["leader", "durable"])
def test_a_leader_of_the_lane_killed_under_load_loses_nothing(tmp_path, sdk, case):
    # the work stream's leader, or the lane's interactive durable's: the supervisor restarts the
    # member at once, so it may be elected again; until the election the stream or durable has no
    # leader (the restarted member answers the durable's info without naming one), nothing is lost,
    # and the requests in flight went to the sidecars on the direct path instead of waiting for it
    report = run_case(tmp_path, case)
    check(report)
    assert report["direct_items"] > 0, report


def test_the_sidecars_member_killed_under_load_loses_nothing(tmp_path, sdk):
    check(run_case(tmp_path, "sidecar"))


@pytest.mark.timeout(600)
def test_the_gateways_member_stopped_30_s_under_load_loses_nothing(tmp_path, sdk):
    check(run_case(tmp_path, "stop", duration_s=50.0))
