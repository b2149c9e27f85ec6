"""The cluster benchmark's round method: both front doors measured in alternating slices."""

from __future__ import annotations

from tests.benchmarks.run import side_by_side


def test_slices_alternate_and_results_pool_per_target():
    calls = []

    def runner(name, rate, latency):
        def run(seconds, latencies):
            calls.append((name, seconds))
            latencies.extend([latency] * 10)
            return rate, 0.0, 0.0

        return run

    a, b = side_by_side(runner("a", 100.0, 0.010), runner("b", 50.0, 0.020), seconds=8.0, segments=4)
    assert calls == [
        ("a", 2.0),
        ("b", 2.0),
        ("b", 2.0),
        ("a", 2.0),
        ("a", 2.0),
        ("b", 2.0),
        ("b", 2.0),
        ("a", 2.0),
    ]
    assert a == (100.0, 10.0, 10.0) and b == (50.0, 20.0, 20.0)
    calls.clear()
    side_by_side(runner("a", 1.0, 0.001), runner("b", 1.0, 0.001), seconds=3.0, segments=1, rotate=1)
    assert calls == [("b", 3.0), ("a", 3.0)]
