"""``sie status``, ``sie models list`` and ``sie logs`` piped into a reader that stops reading
(issue 36, item 9): they end quietly, as Unix tools do, with no BrokenPipeError traceback.

Each runs as a real subprocess. For ``logs``, the reader is ``head -n 1`` over a log far larger than
a pipe holds; for the short outputs of ``status`` and ``models list``, the reader has closed its
end before the command writes, so the first write meets the closed pipe whatever the timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.nats_server import free_port
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR

REPO = Path(__file__).resolve().parents[3]
SIGPIPE_EXIT = 128 + signal.SIGPIPE


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIE_")}
    env.update({"PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(tmp_path / "xdg")})
    return env


def _sie(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", *args]


def _into_closed_pipe(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` with stdout a pipe whose reader has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            cmd, stdout=write_end, stderr=subprocess.PIPE, env=_env(tmp_path), cwd=tmp_path, timeout=120
        )
    finally:
        os.close(write_end)


def _state_dir(tmp_path: Path) -> Path:
    """The state directory of a ``sie up`` that has stopped: status.json and a long gateway log."""
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    log = state / "logs" / "gateway.log"
    log.write_text(
        "".join(f"2026-11-26 10:00:00,000 INFO sie.gateway: line {i} of a long log\n" for i in range(50_000))
    )
    children = [{"name": "gateway", "state": "stopped", "pid": None, "restarts": 0, "log": str(log)}]
    (state / "status.json").write_text(json.dumps({"supervisor_pid": None, "children": children}))
    return state


def _no_traceback(stderr: bytes) -> None:
    text = stderr.decode(errors="replace")
    assert "Traceback" not in text and "BrokenPipeError" not in text and "Exception ignored" not in text, text


def test_sie_logs_into_head_stops_quietly(tmp_path):
    state = _state_dir(tmp_path)
    reader = subprocess.Popen(["head", "-n", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert reader.stdin is not None
    writer = subprocess.run(
        _sie("logs", "gateway", "--state-dir", str(state)),
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=120,
    )
    reader.stdin.close()
    assert reader.stdout is not None
    first = reader.stdout.read()
    reader.wait(30)
    assert first.decode().startswith("2026-11-26 10:00:00,000 INFO sie.gateway: line 0 ")
    _no_traceback(writer.stderr)
    assert writer.returncode == SIGPIPE_EXIT


def test_sie_status_into_a_closed_pipe_stops_quietly(tmp_path):
    state = _state_dir(tmp_path)
    out = _into_closed_pipe(_sie("status", "--state-dir", str(state)), tmp_path)
    _no_traceback(out.stderr)
    assert out.returncode == SIGPIPE_EXIT


@pytest.fixture
def config_service(tmp_path):
    """A real config service (SQLite, the built-in catalog, no NATS) as ``sie up`` starts it."""
    port = free_port()
    env = _env(tmp_path)
    env.update(
        {
            "SIE_CONFIG_HOST": "127.0.0.1",
            "SIE_CONFIG_PORT": str(port),
            "SIE_CONFIG_STATE_DIR": str(tmp_path / "config"),
            "SIE_ADMIN_TOKEN": "admin-secret",
            "SIE_NATS_URL": "",
            "SIE_MODELS_DIR": str(DEFAULT_MODELS_DIR),
            "SIE_BUNDLES_DIR": str(DEFAULT_BUNDLES_DIR),
        }
    )
    log = tmp_path / "config.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "config_service"],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"config service not ready: {log.read_text()}"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_sie_models_list_into_a_closed_pipe_stops_quietly(tmp_path, config_service):
    listed = subprocess.run(
        _sie("models", "list", "--url", config_service, "--token", "admin-secret"),
        capture_output=True,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=120,
    )
    assert listed.returncode == 0 and b"sie-fake" in listed.stdout, listed.stderr  # it does print
    out = _into_closed_pipe(
        _sie("models", "list", "--url", config_service, "--token", "admin-secret"), tmp_path
    )
    _no_traceback(out.stderr)
    assert out.returncode == SIGPIPE_EXIT
