"""The members ``sie up --nats-replicas 3`` starts drop the routes of a member that hangs within a few
seconds. Until a route closes, the other members still count the subscriptions of the hung member's
clients, and a queue group (the sidecars' direct path, docs/ha.md) sends some of its messages
there, where they are lost; NATS pings routes every 30 s at most, and a hung member's routes stayed
for the 10 s write deadline and more."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request

from deploy.launcher import Cluster
from tests.support.nats_server import free_port_run
from tests.support.polling import wait_until


def routes_to(monitor_port: int) -> set[str]:
    """The members a member has routes to (``/routez``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/routez", timeout=2) as r:
        return {route.get("remote_name", "") for route in json.load(r)["routes"]}


def test_a_hung_members_routes_are_dropped_within_seconds(tmp_path):
    cluster = Cluster(state_dir=tmp_path, nats_port=free_port_run(9), nats_replicas=3)
    members = [
        subprocess.Popen(cluster.nats_command(i), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(3)
    ]
    first, hung = cluster.nats_monitor_ports[0], members[2]
    try:

        def meshed() -> bool:
            try:
                return routes_to(first) >= {"nats-2", "nats-3"}
            except OSError:
                return False

        asyncio.run(wait_until(meshed, 30, interval_s=0.2, what="a full mesh of routes"))
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            # 1 s pings, dropped at the second unanswered: about 3 s (the default took 20 s and more)
            asyncio.run(
                wait_until(
                    lambda: "nats-3" not in routes_to(first),
                    10,
                    interval_s=0.2,
                    what="nats-3's routes dropped",
                )
            )
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        # and it joins again once it answers
        asyncio.run(wait_until(meshed, 30, interval_s=0.2, what="nats-3 back in the mesh"))
    finally:
        for member in members:
            member.terminate()
        for member in members:
            member.wait(10)
