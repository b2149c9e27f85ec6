"""Start ``sie serve`` in a subprocess on a free loopback port, for tests that need real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support import processes
from tests.support.nats_server import free_port

REPO = Path(__file__).resolve().parents[2]


class ServeProcess:
    """``sie serve``; a subclass names another HTTP server (``command``, ``name``, ``ready_path``)
    and gets the same start, readiness wait, log and stop."""

    name = "sie serve"
    log_prefix = "sie-serve"
    ready_path = "/readyz"  # answers 200 once the server takes requests
    ready_timeout_s = 180.0

    def __init__(self, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.env = {**os.environ, "SIE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.env.setdefault("SIE_TORCH_THREADS", "1")
        self.cwd: Path | str = REPO
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix=f"{self.log_prefix}-", suffix=".log")
        os.close(fd)
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, timeout: float | None = None) -> ServeProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stop()
        self.proc = subprocess.Popen(
            self.command(), env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + (timeout or self.ready_timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        processes.stop(self.proc, 10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
