"""The supervisor behind ``sie up``: restart with backoff, keep the others running, count restarts,
give up on a crash loop naming the child and its log; ``sie status`` reads its state file."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

from deploy.supervisor import RestartPolicy, Supervisor, read_status, status

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASHER = [sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(3)"]
FAST = RestartPolicy(backoff_base_s=0.01, backoff_max_s=0.05, crash_loop_restarts=5, crash_loop_window_s=60)


def _until(cond, timeout: float = 20.0) -> None:  # generous: only guards against a hang
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_backoff_grows_from_an_immediate_first_restart():
    p = RestartPolicy(backoff_base_s=1.0, backoff_max_s=30.0)
    assert [p.backoff(n) for n in range(7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


def test_a_killed_child_is_restarted_and_the_others_keep_running(tmp_path):
    said: list[str] = []
    sup = Supervisor(tmp_path, FAST, say=said.append)
    try:
        victim = sup.spawn("victim", SLEEPER, dict(os.environ))
        other = sup.spawn("other", SLEEPER, dict(os.environ))
        os.kill(victim.pid, signal.SIGKILL)
        _until(lambda: (sup.check(), sup.children["victim"].restarts == 1)[1])
        new = sup.children["victim"].proc
        assert new.pid != victim.pid and new.poll() is None
        assert sup.children["other"].proc is other and other.poll() is None
        assert sup.children["other"].restarts == 0
        assert any("victim exited with -9" in s and "victim.log" in s for s in said), said
        doc = read_status(tmp_path)
        rows = {c["name"]: c for c in doc["children"]}
        assert rows["victim"]["restarts"] == 1 and rows["victim"]["last_exit"] == -9
        assert rows["victim"]["pid"] == new.pid and rows["victim"]["state"] == "running"
        out = io.StringIO()
        assert status(tmp_path, out) == 0  # this process is the supervisor: "running"
        line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("victim"))
        assert line.split()[1:5] == ["running", str(new.pid), "1", "-9"], out.getvalue()
    finally:
        sup.stop_all(timeout_s=5)
    assert all(c.proc.poll() is not None for c in sup.children.values())
    assert {c["state"] for c in read_status(tmp_path)["children"]} == {"stopped"}


def test_a_crash_loop_gives_up_naming_the_child_and_its_log(tmp_path):
    said: list[str] = []
    sup = Supervisor(tmp_path, FAST, say=said.append)
    try:
        sup.spawn("steady", SLEEPER, dict(os.environ))
        sup.spawn("crasher", CRASHER, dict(os.environ))
        deadline = time.monotonic() + 30  # generous: only guards against a hang
        assert sup.run(lambda: time.monotonic() > deadline, interval_s=0.01) == 1
        crasher = sup.children["crasher"]
        assert crasher.restarts == 5 and crasher.state == "crash-loop"
        assert "crasher is crash-looping" in said[-1] and str(tmp_path / "logs" / "crasher.log") in said[-1]
        assert (tmp_path / "logs" / "crasher.log").read_text().count("boom") == 6
        assert sup.children["steady"].restarts == 0
    finally:
        sup.stop_all(timeout_s=5)


def test_status_says_when_sie_up_is_not_running(tmp_path):
    import json
    import subprocess

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    doc = {
        "supervisor_pid": gone.pid,
        "children": [
            {
                "name": "worker",
                "state": "running",
                "pid": gone.pid,
                "restarts": 2,
                "last_exit": -9,
                "log": "w.log",
            }
        ],
    }
    (tmp_path / "status.json").write_text(json.dumps(doc))
    out = io.StringIO()
    assert status(tmp_path, out) == 1
    assert "not running" in out.getvalue()
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("worker"))
    assert line.split()[1] == "exited" and line.split()[3:5] == ["2", "-9"]
    assert status(tmp_path / "nowhere", io.StringIO()) == 1


def test_children_have_their_own_session_and_stop_one_by_one_in_reverse_order(tmp_path):
    said: list[tuple[str, set[str]]] = []  # each message with the children that had exited by then
    sup = Supervisor(tmp_path, FAST)
    sup.say = lambda s: said.append((s, {n for n, c in sup.children.items() if c.proc.poll() is not None}))
    try:
        for name in ("nats", "worker", "gateway"):
            sup.spawn(name, SLEEPER, dict(os.environ))
        # the terminal's Ctrl-C goes to the foreground process group: not theirs
        assert all(os.getsid(c.proc.pid) == c.proc.pid != os.getsid(0) for c in sup.children.values())
    finally:
        sup.stop_all(timeout_s=5)
    stops = [(s.split()[1], gone) for s, gone in said if s.startswith("stopping ")]
    # each is stopped only once the one started after it has exited
    assert stops == [("gateway", set()), ("worker", {"gateway"}), ("nats", {"gateway", "worker"})], said
    assert said[-1] == ("all processes stopped", {"nats", "worker", "gateway"})


def test_log_echo_prints_the_progress_lines_appended_after_it_starts(tmp_path):
    import json as _json
    import time as _time

    from deploy.launcher import PROGRESS_MARKS, LogEcho, log_message

    log = tmp_path / "worker.log"
    log.write_text(
        "2026-11-23 04:00:00,000 INFO worker.runtime: loading old-model (profile default, attempt 1)\n"
    )
    seen: list[str] = []
    echo = LogEcho(log, PROGRESS_MARKS, seen.append, interval_s=0.02)
    try:
        with log.open("a") as f:
            f.write("2026-11-23 04:00:01,000 INFO sie.worker.ipc: IPC server listening on /tmp/x.sock\n")
            f.write("2026-11-23 04:00:02,000 INFO worker.runtime: loading m… done in 4.0 s\n")
            f.write(
                _json.dumps({"ts": 1, "level": "INFO", "msg": "downloading m: 10 MB of 90 MB, 5.0 MB/s"})
                + "\n"
            )
            f.write("2026-11-23 04:00:03,000 INFO worker.runtime: loading half a li")  # no newline yet
        deadline = _time.monotonic() + 30
        while len(seen) < 2 and _time.monotonic() < deadline:
            _time.sleep(0.02)
        assert seen[:2] == ["loading m… done in 4.0 s", "downloading m: 10 MB of 90 MB, 5.0 MB/s"]
    finally:
        echo.close()
    assert len(seen) == 2  # neither the line before it started nor the unfinished one
    assert log_message("plain text without a logger") == "plain text without a logger"


def test_each_run_starts_its_own_logs_and_keeps_the_previous_runs(tmp_path):
    """Issue 36: a log is this run's alone; the run before's moves to logs/previous/, and a restart
    within the run appends to the run's log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "crasher.log").write_text("from the run before\n")
    sup = Supervisor(tmp_path, FAST, say=lambda s: None)
    try:
        sup.spawn("crasher", CRASHER, dict(os.environ))
        _until(lambda: (sup.check(), sup.children["crasher"].restarts >= 1)[1])
        _until(lambda: (logs / "crasher.log").read_text().count("boom") >= 2)
    finally:
        sup.stop_all(timeout_s=5)
    assert "from the run before" not in (logs / "crasher.log").read_text()
    assert (logs / "previous" / "crasher.log").read_text() == "from the run before\n"


def test_fresh_log_keeps_one_run_before(tmp_path):
    from deploy.supervisor import fresh_log

    path = tmp_path / "logs" / "sie-up.log"
    assert fresh_log(path) == path and not path.exists() and path.parent.is_dir()
    path.write_text("run 1\n")
    fresh_log(path)
    path.write_text("run 2\n")
    fresh_log(path)
    assert not path.exists()
    assert (path.parent / "previous" / "sie-up.log").read_text() == "run 2\n"


def test_a_child_runs_on_its_cpus_and_so_does_its_restart(tmp_path):
    cpus = frozenset([max(os.sched_getaffinity(0))])
    sup = Supervisor(tmp_path, FAST, say=lambda _: None)
    try:
        pinned = sup.spawn("pinned", SLEEPER, dict(os.environ), cpus=cpus)
        free = sup.spawn("free", SLEEPER, dict(os.environ))
        assert os.sched_getaffinity(pinned.pid) == cpus
        assert os.sched_getaffinity(free.pid) == os.sched_getaffinity(0)
        os.kill(pinned.pid, signal.SIGKILL)
        _until(lambda: (sup.check(), sup.children["pinned"].restarts == 1)[1])
        assert os.sched_getaffinity(sup.children["pinned"].proc.pid) == cpus
    finally:
        sup.stop_all(timeout_s=5)
