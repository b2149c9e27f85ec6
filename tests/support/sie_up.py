"""``sie up`` run as a user runs it, for the cluster tests: its command line and environment on free
ports, its process, and the waits for it to be ready."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support import processes
from tests.support.cluster import wait_for_worker
from tests.support.nats_server import free_port, free_port_run
from tests.support.processes import Identity, ctrl_c_at_default, identities, kill_if_same

REPO = Path(__file__).resolve().parents[2]
SDK = {"Accept": "application/json", "X-SIE-SDK-Version": "0.10.1"}  # what the public sie-sdk sends
# health published every second and gateways that wait a second for workers: a cluster ready sooner
FAST = {"SIE_HEALTH_PUBLISH_INTERVAL_MS": "1000", "SIE_GATEWAY_WORKER_WARMUP_S": "1"}


def free_ports() -> dict[str, int]:
    """Ports for a gateway (``gw``), a config service (``cfg``) and a nats-server (``nats``)."""
    return {"gw": free_port(), "cfg": free_port(), "nats": free_port()}


def cli(*args: str) -> list[str]:
    """The command line of ``sie <args>``."""
    return [sys.executable, "-m", "deploy.cli", *args]


def up_args(state: Path, ports: dict[str, int], preload: str = "sie-fake") -> list[str]:
    """``up`` on ``ports`` (as free_ports names them) with its state in ``state``, ``preload`` loaded."""
    return [
        "up",
        "--port",
        str(ports["gw"]),
        "--config-port",
        str(ports["cfg"]),
        "--nats-port",
        str(ports["nats"]),
        "--state-dir",
        str(state),
        "--preload",
        preload,
    ]


def user_env(xdg: Path, settings: dict[str, str] | None = None, drop: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment without its ``SIE_*`` variables (nor ``drop``), offline, one torch
    thread, ``xdg`` as the XDG state home (where sie up records its state directory), and then
    ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIE_") and k not in drop}
    env.update(
        {
            "SIE_HF_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "SIE_TORCH_THREADS": "1",
            "XDG_STATE_HOME": str(xdg),
            **(settings or {}),
        }
    )
    return env


def launch(args: list[str], env: dict[str, str], *, own_session: bool = False) -> subprocess.Popen:
    """``sie <args>`` from the checkout, its output piped, SIGINT at its default so that a test's
    Ctrl-C reaches it; with ``own_session``, in a process group of its own as a shell's foreground
    job is."""
    return subprocess.Popen(
        cli(*args),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=own_session,
        preexec_fn=ctrl_c_at_default,
    )


def wait_readyz(proc: subprocess.Popen, gateway: str, timeout: float = 120) -> None:
    """Until the gateway answers ``/readyz`` with 200 (for at most ``timeout`` s, generous: only a
    guard against a hang); fails with sie up's output if sie up exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(gateway + "/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.3)


def wait_status_ready(proc: subprocess.Popen, state: Path, deadline: float) -> None:
    """Until sie up's ``status.json`` in ``state`` says ready; fails with sie up's output if sie up
    exits first or ``deadline`` (time.monotonic) passes."""
    while (
        not (state / "status.json").exists() or not json.loads((state / "status.json").read_text())["ready"]
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.3)


@dataclass(eq=False)
class SieUp:
    """``python -m deploy.cli up`` as a subprocess on free ports, with ``preload`` (sie-fake) loaded."""

    state: Path
    preload: str = "sie-fake"
    gateways: int = 1
    workers: int = 1
    model_processes: int = 1
    metrics_port: int = 0
    nats_replicas: int = 1
    extra_env: dict[str, str] | None = None
    config_replicas: int = 1
    config_db: str = ""

    def __post_init__(self) -> None:
        # a cluster's members take the 3 × replicas ports from --nats-port on (clients, routes, monitoring)
        replicas = self.nats_replicas
        nats = free_port() if replicas == 1 else free_port_run(3 * replicas)
        cfg = free_port() if self.config_replicas == 1 else free_port_run(self.config_replicas)
        self.ports = {"gw": free_port(), "cfg": cfg, "nats": nats}
        self.env = user_env(self.state.parent / "xdg", {**FAST, **(self.extra_env or {})})
        self.gateway = f"http://127.0.0.1:{self.ports['gw']}"
        # the members' monitoring ports (/healthz, /jsz), after their client and route ports
        self.nats_monitor_ports = [nats + 2 * replicas + i for i in range(replicas)] if replicas > 1 else []
        self.proc: subprocess.Popen | None = None
        self.pids: set[Identity] = set()  # every child it had, by pid and start time

    def start(self) -> SieUp:
        self.proc = launch(
            [
                *up_args(self.state, self.ports, self.preload),
                "--gateways",
                str(self.gateways),
                "--workers",
                str(self.workers),
                "--model-processes",
                str(self.model_processes),
                "--metrics-port",
                str(self.metrics_port),
                "--nats-replicas",
                str(self.nats_replicas),
                "--config-replicas",
                str(self.config_replicas),
                *(["--config-db", self.config_db] if self.config_db else []),
            ],
            self.env,
        )
        wait_readyz(self.proc, self.gateway)
        wait_for_worker(self.gateway)
        return self

    def children(self) -> dict[str, dict]:
        doc = json.loads((self.state / "status.json").read_text())
        rows = {c["name"]: c for c in doc["children"]}
        self.pids |= identities(c["pid"] for c in rows.values())
        return rows

    def status_command(self) -> tuple[int, str]:
        out = subprocess.run(
            cli("status", "--state-dir", str(self.state)),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.returncode, out.stdout + out.stderr

    def stop(self) -> str:
        processes.stop(self.proc, 60, signal.SIGINT)
        output = self.proc.stdout.read() if self.proc is not None else ""
        kill_if_same(self.pids)
        return output
