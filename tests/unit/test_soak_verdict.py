"""The soak's growth verdict (tests/support/soak.py): connections moved from a killed process to a
survivor are no leak, nor is a garbage collector's cycle; descriptors, RSS or connections that grow
are."""

from __future__ import annotations

import os
import socket

from tests.support.soak import ALL_TCP, Minute, Plan, Sample, Soak, established_sockets, proc_stats, summarise


def judged(procs_at) -> list[str]:
    """``procs_at(minute)`` → {name: (rss kB, own fds, tcp)} for minutes 1..60; the names judged to grow."""
    soak = Soak(up=None, plan=Plan(minutes=60))
    soak.samples = [
        Sample(m, {name: Minute(100 + i, *stats) for i, (name, stats) in enumerate(procs_at(m).items())})
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


def test_a_collectors_cycle_is_no_leak_and_memory_never_given_back_is():
    # nats-server over an hour (docs/ha.md): the RSS of each minute swings between its collector's
    # phases, here low in every minute at the start and mostly high at the end, the lowest read of
    # each minute 31 MB throughout
    def cycling(m):
        low_minute = m % 2 == 0 if m < 30 else m % 5 == 4
        return {**steady(m), "nats": (31_000, 20, 9, 33_000 if low_minute else 39_000)}

    def leaking(m):  # the same cycle over memory that grows by 100 kB a minute and is never freed
        return {**steady(m), "nats": (31_000 + 100 * m, 20, 9, 35_000 + 100 * m)}

    assert judged(cycling) == []
    assert judged(leaking) == ["nats"]


def test_a_minute_is_its_lowest_rss_and_the_median_counts_and_a_successor_counts_alone():
    # a garbage-collected heap: one read a minute would land anywhere in the swing
    probes = [
        {"nats": (7, rss, fds, 10)} for rss, fds in ((31_000, 17), (40_000, 18), (33_000, 17), (39_000, 19))
    ]
    assert summarise(probes) == {"nats": Minute(7, 31_000, 18, 10, 36_000)}
    # gateway-2 killed and restarted mid-minute: its predecessor's reads are not its own
    restarted = [
        {"gateway-2": (5, 90_000, 30, 8)},
        {"gateway-2": (5, 90_000, 30, 8)},
        {"gateway-2": (9, 60_000, 14, 1)},
    ]
    assert summarise(restarted) == {"gateway-2": Minute(9, 60_000, 14, 1, 60_000)}
