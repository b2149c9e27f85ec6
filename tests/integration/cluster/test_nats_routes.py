"""The members ``sie up --nats-replicas 3`` starts drop the routes of a member that hangs by their
pings. Until a route closes, the other members still count the subscriptions of the hung member's
clients, and a queue group (the sidecars' direct path, docs/ha.md) sends some of its messages
there, where they are lost. NATS pings routes every 30 s at most and calls a route stale at the
third ping without an answer, so a hung member's routes stayed until the 10 s write deadline or a
minute and more; with ``ping_interval: "1s"`` and ``ping_max: 2`` they go as stale in about 3 s."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request

from deploy.launcher import Cluster
from tests.support.nats_server import free_port_run
from tests.support.polling import wait_until


def monitor(port: int, endpoint: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{endpoint}", timeout=2) as r:
        return json.load(r)


def routes_to(monitor_port: int) -> set[str]:
    """The members a member has routes to (``/routez``)."""
    return {route.get("remote_name", "") for route in monitor(monitor_port, "routez")["routes"]}


def stale_routes(monitor_port: int) -> int:
    """How many of a member's routes it closed for pings without an answer (``/varz``)."""
    return (monitor(monitor_port, "varz").get("stale_connection_stats") or {}).get("routes", 0)


def test_a_hung_members_routes_are_dropped_by_their_pings(tmp_path):
    cluster = Cluster(state_dir=tmp_path, nats_port=free_port_run(9), nats_replicas=3)
    logs = [tmp_path / f"{name}.log" for name in cluster.nats_names]
    members = [
        subprocess.Popen(cluster.nats_command(i), stdout=log.open("w"), stderr=subprocess.STDOUT)
        for i, log in enumerate(logs)
    ]
    first, hung = cluster.nats_monitor_ports[0], members[2]

    def meshed() -> bool:
        try:
            return routes_to(first) >= {"nats-2", "nats-3"}
        except OSError:
            return False

    try:
        asyncio.run(wait_until(meshed, 30, interval_s=0.2, what="a full mesh of routes"))
        stale_before = stale_routes(first)
        os.kill(hung.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            # about 3 s (1 s pings, stale at the third unanswered); without the setting the routes
            # went at the write deadline (not as stale) or after a minute, so the count tells
            while "nats-3" in routes_to(first) and time.monotonic() - stopped < 30:
                time.sleep(0.2)
            log = logs[0].read_text().splitlines()[-20:]
            assert "nats-3" not in routes_to(first), f"nats-3 still routed after 30 s: {log}"
            assert stale_routes(first) > stale_before, f"nats-3's routes closed, not for pings: {log}"
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        # and it joins again once it answers
        asyncio.run(wait_until(meshed, 30, interval_s=0.2, what="nats-3 back in the mesh"))
    finally:
        for member in members:
            member.terminate()
        for member in members:
            member.wait(10)
