"""path_cpu's per-thread lines (``--per-thread``): what a slice adds to each thread's schedstat."""

from __future__ import annotations

import os
import threading

from tests.benchmarks.path_cpu import ThreadSched, sched_of, thread_lines, threads_of


def test_a_busy_threads_share_runs_and_wait_come_from_its_schedstat_deltas():
    before = {
        (1, 10): ThreadSched("python", 1.0, 1_000_000_000, 0, 100),
        (1, 11): ThreadSched("idle", 0.0, 0, 0, 0),
    }
    after = {
        (1, 10): ThreadSched("python", 1.5, 1_500_000_000, 250_000_000, 1100),  # +0.5 s ran, +0.25 s waited
        (1, 11): ThreadSched("idle", 0.0, 5_000_000, 0, 3),  # 0.5 % of a core: left out
        (1, 12): ThreadSched("new", 0.2, 200_000_000, 0, 50),  # started during the slice
    }
    lines = thread_lines(before, after, elapsed=1.0, requests=500)
    assert len(lines) == 2
    assert "python" in lines[0] and "ran 0.50  waited 0.25" in lines[0]
    assert "2.0 runs/request" in lines[0] and "250 us waited a run" in lines[0]
    assert "new" in lines[1] and "ran 0.20" in lines[1]


def test_the_threads_of_this_process_are_read_with_their_names():
    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def extra() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait()

    t = threading.Thread(target=extra)
    t.start()
    try:
        assert started.wait(10)
        seen = threads_of(os.getpid(), tree=False)
        assert {(os.getpid(), threading.get_native_id()), (os.getpid(), tids[0])} <= seen.keys()
        assert all(s.name and s.run_ns >= 0 and s.slices >= 0 for s in seen.values())
        whole = sched_of(os.getpid(), tree=False)  # read after: at least what this thread had run
        assert whole.run_s >= seen[(os.getpid(), threading.get_native_id())].run_ns / 1e9 > 0
    finally:
        stop.set()
        t.join()
