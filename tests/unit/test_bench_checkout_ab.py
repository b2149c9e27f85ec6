"""checkout_ab's CPU per role: which child of ``sie up`` a process is, and its CPU summed by role."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.benchmarks.checkout_ab import cpu_by_role, role_of
from tests.support.processes import descendants

SPIN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)"


def _child(*module: str) -> subprocess.Popen[bytes]:
    # `python -c CODE -m NAME`: -c ends the interpreter's options, so "-m NAME" stays in argv as a
    # `python -m NAME` child's command line reads
    return subprocess.Popen([sys.executable, "-c", SPIN, *module])


def test_children_of_sie_up_are_named_by_their_module_and_their_cpu_summed_per_role():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, '-c', {SPIN!r}, '-m', 'gateway'])\n"
         f"subprocess.Popen([sys.executable, '-c', {SPIN!r}, '-m', 'sidecar'])\n"
         "time.sleep(30)"]
    )  # fmt: skip
    other = _child("-m", "config_service")
    try:
        deadline = time.monotonic() + 10
        used = cpu_by_role(parent.pid)
        while (used["gateway"] < 0.25 or used["sidecar"] < 0.25) and time.monotonic() < deadline:
            time.sleep(0.1)
            used = cpu_by_role(parent.pid)
        assert used["gateway"] >= 0.25 and used["sidecar"] >= 0.25, used
        assert used["nats"] == 0.0 and used["worker"] == 0.0
        assert role_of(other.pid) is None  # the config service counts in no role
        assert role_of(parent.pid) is None
    finally:
        for pid in descendants(parent.pid):
            if pid != parent.pid:
                os.kill(pid, signal.SIGKILL)
        for p in (parent, other):
            p.kill()
            p.wait()
