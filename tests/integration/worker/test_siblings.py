"""protocol.siblings: how a pod's model processes are named, restarted and stopped."""

from __future__ import annotations

import time

from protocol.siblings import RESTART_DELAY_S, Siblings, process_socket, process_worker_id


def test_process_i_is_named_from_the_pods_own_settings():
    assert process_socket("/var/run/sie/ipc.sock", 0) == "/var/run/sie/ipc.sock"
    assert process_socket("/var/run/sie/ipc.sock", 3) == "/var/run/sie/ipc.p3.sock"
    assert process_socket("/tmp/state/ipc-2.sock", 1) == "/tmp/state/ipc-2.p1.sock"
    assert process_worker_id("sie-w-default-l4-0", 0) == "sie-w-default-l4-0"
    assert process_worker_id("sie-w-default-l4-0", 2) == "sie-w-default-l4-0-p2"


def test_a_sibling_that_exits_is_restarted_with_a_growing_delay_and_stop_ends_them_all():
    # a module that does not exist: each start exits at once with an error
    crashing = Siblings("sie_no_such_module", 2).start()
    try:
        time.sleep(RESTART_DELAY_S * 4)
        # restarted after 1 s, then 2 s: two or three restarts in 4 s, not one per watcher tick
        assert 1 <= crashing.restarts <= 3, crashing.restarts
    finally:
        crashing.stop(5)
    restarts = crashing.restarts
    time.sleep(1.5)
    assert crashing.restarts == restarts  # none after stop


def test_stop_terminates_running_siblings():
    running = Siblings("tests.support.idle_process", 3).start()
    procs = list(running.procs.values())
    assert sorted(running.procs) == [1, 2]  # processes 1 and 2; this one is process 0
    time.sleep(0.5)
    assert all(p.poll() is None for p in procs)
    running.stop(10)
    assert [p.returncode for p in procs] == [-15, -15]  # SIGTERM, not the SIGKILL after the wait
