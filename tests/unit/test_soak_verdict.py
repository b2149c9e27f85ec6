"""The soak's growth verdict (tests/support/soak.py): connections moved from a killed process to a
survivor are no leak; descriptors, RSS or connections that grow are."""

from __future__ import annotations

import os
import socket

from tests.support.soak import ALL_TCP, Plan, Sample, Soak, established_sockets, medians, proc_stats


def judged(procs_at) -> list[str]:
    """``procs_at(minute)`` → {name: (rss kB, own fds, tcp)} for minutes 1..60; the names judged to grow."""
    soak = Soak(up=None, plan=Plan(minutes=60))
    soak.samples = [
        Sample(m, {name: (100 + i, *stats) for i, (name, stats) in enumerate(procs_at(m).items())})
        for m in range(1, 61)
    ]
    soak._growth()
    return soak.report.grew


def steady(m: int) -> dict[str, tuple[int, int, int]]:
    return {"gateway": (70_000, 13, 6), "gateway-2": (70_000, 13, 6), "driver": (120_000, 9, 12)}


def test_a_steady_cluster_passes():
    assert judged(steady) == []


def test_connections_moved_to_a_survivor_are_no_leak():
    def moved(m):
        procs = steady(m)
        if m >= 22:  # gateway-2 killed: the driver's connections all reconnect to gateway
            procs["gateway"], procs["gateway-2"] = (70_000, 13, 9), (70_000, 13, 3)
        return procs

    assert judged(moved) == []


def test_own_descriptors_rss_or_the_connections_overall_that_grow_fail():
    def leaking_files(m):
        return {**steady(m), "gateway": (70_000, 13 + m // 10, 6)}  # 14 → 19 open files

    def leaking_memory(m):
        return {**steady(m), "gateway-2": (70_000 + 300 * m, 13, 6)}

    def leaking_connections(m):  # a client that opens connections and never closes them
        return {**steady(m), "driver": (120_000, 9, 12 + m // 10), "gateway": (70_000, 13, 6 + m // 10)}

    assert judged(leaking_files) == ["gateway"]
    assert judged(leaking_memory) == ["gateway-2"]
    assert judged(leaking_connections) == [ALL_TCP]


def test_a_processes_connections_are_counted_apart_from_its_other_descriptors():
    listener = socket.create_server(("127.0.0.1", 0))
    before = proc_stats(os.getpid(), established_sockets())
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        rss, own, tcp = proc_stats(os.getpid(), established_sockets())
        assert before is not None and rss > 0
        assert (own, tcp) == (before[1], before[2] + 2)  # both ends live in this process
    finally:
        client.close()
        server.close()
        listener.close()


def test_a_minute_is_the_median_of_its_reads_and_a_successor_counts_alone():
    # a garbage-collected heap: one read a minute would land anywhere in the swing
    probes = [{"nats": (7, rss, 17, 10)} for rss in (31_000, 40_000, 33_000, 39_000, 35_000)]
    assert medians(probes) == {"nats": (7, 35_000, 17, 10)}
    # gateway-2 killed and restarted mid-minute: its predecessor's reads are not its own
    restarted = [
        {"gateway-2": (5, 90_000, 30, 8)},
        {"gateway-2": (5, 90_000, 30, 8)},
        {"gateway-2": (9, 60_000, 14, 1)},
    ]
    assert medians(restarted) == {"gateway-2": (9, 60_000, 14, 1)}
