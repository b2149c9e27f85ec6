"""A ``sie up --detach`` that fails says why with its own output only (issue 36, item 7): the
lines of an earlier run that came up are not in what it prints, nor in its log."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from deploy.state import LOCK_FILE
from tests.support.nats_server import free_port

REPO = Path(__file__).resolve().parents[3]
EARLIER = "sie-cluster is up: point a client at http://127.0.0.1:1 (an earlier run)"


def test_a_failed_detached_sie_up_prints_only_its_own_run(tmp_path):
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "sie-up.log").write_text(f"nats-server     nats://127.0.0.1:1\n{EARLIER}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIE_")}
    env.update({"PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(tmp_path / "xdg")})
    ports = [str(free_port()) for _ in range(3)]
    # another process holds the state directory's lock, so the detached sie up stops at once
    with open(state / LOCK_FILE, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        run = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "up", "--detach", "--state-dir", str(state)]
            + ["--port", ports[0], "--config-port", ports[1], "--nats-port", ports[2]],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "sie up exited before the cluster was ready" in run.stderr
    assert "another sie up holds" in run.stderr, run.stderr  # the real reason
    assert EARLIER not in run.stderr and "nats-server" not in run.stderr
    log = (state / "logs" / "sie-up.log").read_text()
    assert "another sie up holds" in log and EARLIER not in log
    assert EARLIER in (state / "logs" / "previous" / "sie-up.log").read_text()
