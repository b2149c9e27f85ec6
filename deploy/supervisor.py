"""The process supervisor behind ``sie up``: on a laptop it is the container runtime.

A child that exits while the cluster runs is started again with the same command and environment,
after a backoff that grows with the restarts in the current window (first at once, then 1 s, 2 s,
4 s ... up to a cap), as a kubelet restarts a crashed container; the other children keep running.
Every exit and restart is logged and counted. Only a crash loop (``crash_loop_restarts`` restarts
within ``crash_loop_window_s``) makes it give up, naming the child and its log. The state of every
child is kept in ``<state>/status.json`` for ``sie status``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STATUS_FILE = "status.json"
PREVIOUS_LOGS = "previous"  # <state>/logs/previous/: the logs of the run before this one


def fresh_log(path: Path) -> Path:
    """Begin this run's log at ``path``: a log left by an earlier run moves to ``previous/`` beside
    it (one run kept), so what this run prints, and what an error quotes, is this run's alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        keep = path.parent / PREVIOUS_LOGS
        keep.mkdir(exist_ok=True)
        path.replace(keep / path.name)
    return path


@dataclass(frozen=True)
class RestartPolicy:
    backoff_base_s: float = 1.0  # second restart in a window waits this long, then doubling
    backoff_max_s: float = 30.0
    crash_loop_restarts: int = 5  # this many restarts within the window and the next exit gives up
    crash_loop_window_s: float = 60.0

    def backoff(self, recent_restarts: int) -> float:
        if recent_restarts == 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** (recent_restarts - 1))


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)  # monotonic times of restarts in the window
    restart_at: float | None = None  # a restart is due at this monotonic time
    last_exit: int | None = None
    last_restart_wall: float | None = None
    state: str = "running"  # running | restarting | stopped | crash-loop
    cpus: frozenset[int] | None = None  # the CPUs it may run on (a restart too); None: any

    def start(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:  # a restart appends; the child keeps its own descriptor
            # its own session: the terminal's Ctrl-C reaches only ``sie up``, which stops the
            # children in order (stop_all) instead of every process dying at once
            # ... and dies with it: a ``sie up`` killed outright leaves no nats-server on its store
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(_child_setup, self.cpus),
            )
        self.state = "running"
        return self.proc


def _child_setup(cpus: frozenset[int] | None) -> None:
    """Child side of fork: SIGTERM when the supervisor dies, however it died (Linux); then its CPUs,
    which every thread it starts inherits."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cpus:
        os.sched_setaffinity(0, cpus)


class CrashLoop(Exception):
    def __init__(self, child: Child, policy: RestartPolicy) -> None:
        super().__init__(
            f"{child.name} is crash-looping ({len(child.recent)} restarts in "
            f"{policy.crash_loop_window_s:.0f} s, last exit code {child.last_exit}); giving up. "
            f"Its log: {child.log_path}"
        )
        self.child = child


def _say(message: str) -> None:
    print(f"[sie up] {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(
        self, state_dir: Path, policy: RestartPolicy | None = None, say: Callable[[str], None] = _say
    ) -> None:
        self.state_dir = state_dir
        self.policy = policy or RestartPolicy()
        self.say = say
        self.children: dict[str, Child] = {}
        self.info: dict[str, object] = {}  # kept in the state file beside the children (URLs, ready)

    @property
    def status_path(self) -> Path:
        return self.state_dir / STATUS_FILE

    def spawn(
        self, name: str, cmd: list[str], env: dict[str, str], cpus: frozenset[int] | None = None
    ) -> subprocess.Popen:
        child = Child(name, cmd, env, fresh_log(self.state_dir / "logs" / f"{name}.log"), cpus=cpus)
        self.children[name] = child
        proc = child.start()
        self.write_state()
        return proc

    def check(self, now: float | None = None) -> None:
        """One supervision step: notice exits, schedule and perform restarts. Raises CrashLoop."""
        now = time.monotonic() if now is None else now
        changed = False
        for child in self.children.values():
            if child.state in ("stopped", "crash-loop") or child.proc is None:
                continue
            if child.restart_at is None and child.proc.poll() is not None:
                child.last_exit = child.proc.returncode
                while child.recent and now - child.recent[0] > self.policy.crash_loop_window_s:
                    child.recent.popleft()
                if len(child.recent) >= self.policy.crash_loop_restarts:
                    child.state = "crash-loop"
                    self.write_state()
                    raise CrashLoop(child, self.policy)
                delay = self.policy.backoff(len(child.recent))
                child.restart_at = now + delay
                child.state = "restarting"
                self.say(
                    f"{child.name} exited with {child.last_exit}; restarting in {delay:g} s "
                    f"(restart {child.restarts + 1}; log: {child.log_path})"
                )
                changed = True
            if child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                child.recent.append(now)
                child.last_restart_wall = time.time()
                proc = child.start()
                self.say(f"{child.name} restarted (pid {proc.pid}, {child.restarts} restart(s) so far)")
                changed = True
        if changed:
            self.write_state()

    def run(self, stop: Callable[[], bool], interval_s: float = 0.1) -> int:
        """Supervise until ``stop()`` (0) or a crash loop (1)."""
        try:
            while not stop():
                self.check()
                time.sleep(interval_s)
        except CrashLoop as exc:
            self.say(str(exc))
            return 1
        return 0

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Stop the children one by one in reverse start order (the gateway, started last, first):
        SIGTERM, wait up to ``timeout_s`` for it to exit, then SIGKILL. Each stops while the ones it
        depends on still run, so the gateway answers its in-flight requests before the sidecar and
        the worker go."""
        for child in reversed(self.children.values()):
            if child.state != "crash-loop":
                child.state = "stopped"
            child.restart_at = None
        for child in reversed(self.children.values()):
            proc = child.proc
            if proc is None or proc.poll() is not None:
                continue
            self.say(f"stopping {child.name} (pid {proc.pid})")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.say(f"{child.name} did not exit in {timeout_s:g} s; killing it")
                proc.kill()
                proc.wait(5)
        self.say("all processes stopped")
        self.write_state()

    def write_state(self) -> None:
        doc = {
            "supervisor_pid": os.getpid(),
            "updated": time.time(),
            **self.info,
            "children": [
                {
                    "name": c.name,
                    "state": c.state,
                    "pid": c.proc.pid if c.proc is not None else None,
                    "restarts": c.restarts,
                    "last_exit": c.last_exit,
                    "last_restart": c.last_restart_wall,
                    "log": str(c.log_path),
                }
                for c in self.children.values()
            ],
        }
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.status_path)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if "zombie" in Path(f"/proc/{pid}/status").read_text().lower():
            return False
    return True


def read_status(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def status(state_dir: Path, out=sys.stdout) -> int:
    """``sie status``: the children of the ``sie up`` that owns ``state_dir``, their restarts and logs.
    0 when that ``sie up`` is running, 1 otherwise."""
    doc = read_status(state_dir)
    if doc is None:
        print(f"no sie up state in {state_dir}", file=out)
        return 1
    running = pid_alive(doc.get("supervisor_pid"))
    print(f"sie up (pid {doc.get('supervisor_pid')}): {'running' if running else 'not running'}", file=out)
    rows = [("NAME", "STATE", "PID", "RESTARTS", "LAST EXIT", "LOG")]
    for c in doc.get("children", []):
        state = c["state"]
        if state == "running" and not (running and pid_alive(c.get("pid"))):
            state = "exited"
        last = "" if c.get("last_exit") is None else str(c["last_exit"])
        rows.append(
            (c["name"], state, str(c.get("pid") or ""), str(c.get("restarts", 0)), last, c.get("log", ""))
        )
    _table(rows, out)
    if running and doc.get("gateway_url"):
        _model_states(str(doc["gateway_url"]), out)
    return 0 if running else 1


def _table(rows: Sequence[tuple[str, ...]], out) -> None:
    """Columns padded to their widest cell; the last column as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[-1], file=out)


def _model_states(gateway_url: str, out) -> None:
    """The models the workers have loaded, are loading or failed to load, from the gateway."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(gateway_url.rstrip("/") + "/v1/models", timeout=3) as resp:
            models = json.loads(resp.read()).get("models") or []
    except (OSError, ValueError) as exc:
        print(f"\nmodels: the gateway did not answer ({exc})", file=out)
        return
    busy = [m for m in models if m.get("state") in ("loaded", "loading", "failed")]
    if not busy:
        print("\nmodels: none loaded yet (a model loads on its first request, or with --preload)", file=out)
        return
    rows = [("MODEL", "STATE", "WORKERS", "LAST ERROR")]
    for m in busy:
        error = (m.get("last_error") or {}).get("message") or ""
        rows.append((str(m.get("name")), str(m.get("state")), str(m.get("worker_count", 0)), error[:120]))
    print(file=out)
    _table(rows, out)
