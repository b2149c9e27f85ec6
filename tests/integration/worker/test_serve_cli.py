"""``sie serve`` as a user runs it: one clear line on a taken port (no traceback, exit 1), and a
"listening on" line once it serves."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.nats_server import free_port

REPO = Path(__file__).resolve().parents[3]
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "SIE_HF_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "SIE_TORCH_THREADS": "1",
}


def test_serve_on_a_taken_port_says_so_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"sie serve: port {port} is in use on 127.0.0.1 (another sie serve or sie up?); pick another with --port"
    ]


def test_serve_prints_listening_when_it_serves():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--preload",
            "sie-fake",
        ],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # the first stdout line; the process ends the read if it dies
        assert line.strip() == f"sie serve listening on http://127.0.0.1:{port}"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200  # already serving
    finally:
        proc.terminate()
        proc.wait(30)
