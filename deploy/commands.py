"""The ``sie`` commands that talk to a running ``sie up``: ``down``, ``logs``, ``models add``.

Each finds the cluster through its state directory (deploy/state.py) unless told where it is, and
says what is wrong in one line instead of a traceback or a bare HTTP status.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deploy.state import NoCluster, find_state_dir, running
from deploy.supervisor import read_status

PROCESSES = ("nats", "config", "worker", "sidecar", "gateway")


def _fail(message: str) -> int:
    print(f"sie: {message}", file=sys.stderr)
    return 1


def down(state_dir: str | None, timeout_s: float = 120.0) -> int:
    """``sie down``: SIGTERM the ``sie up`` that owns the state directory and wait until it has
    stopped its children (it stops them in order, the gateway first)."""
    try:
        state = find_state_dir(state_dir)
    except NoCluster as exc:
        return _fail(str(exc))
    doc = read_status(state) or {}
    pid = doc.get("supervisor_pid")
    if not running(state) or not isinstance(pid, int):
        return _fail(f"no sie up is running for {state} (last pid {pid}); nothing to stop")
    print(f"stopping sie up (pid {pid}, state {state}); its log says what it stops", flush=True)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running(state):
        if time.monotonic() > deadline:
            return _fail(f"sie up (pid {pid}) is still stopping after {timeout_s:.0f} s")
        time.sleep(0.2)
    print("sie-cluster is down")
    return 0


def logs(state_dir: str | None, process: str | None, follow: bool, out=sys.stdout) -> int:
    """``sie logs [process] [-f]``: one process's log, or all of them with a ``name |`` prefix.
    Replicas (``--gateways``, ``--workers``) are ``gateway-2``, ``worker-2``, ``sidecar-2`` and so on."""
    if process is not None and _replica(process)[0] not in PROCESSES:
        return _fail(f"unknown process {process!r}: one of {', '.join(PROCESSES)} (replicas: worker-2, ...)")
    try:
        state = find_state_dir(state_dir)
    except NoCluster as exc:
        return _fail(str(exc))
    names = [process] if process else _log_names(state / "logs")
    paths = {n: state / "logs" / f"{n}.log" for n in names}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        return _fail(f"no log at {missing[0]}")
    width = max((len(n) for n in names), default=0)
    prefix = (lambda n: f"{n:<{max(8, width)}}| ") if process is None else (lambda n: "")
    offsets = dict.fromkeys(names, 0)

    def pump() -> None:
        for name, path in paths.items():
            with open(path, "rb") as f:
                f.seek(offsets[name])
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
            offsets[name] += end
            for line in data[:end].decode(errors="replace").splitlines():
                print(prefix(name) + line, file=out)
        out.flush()

    pump()
    try:
        while follow:
            time.sleep(0.3)
            pump()
    except KeyboardInterrupt:
        pass
    return 0


def _replica(name: str) -> tuple[str, int]:
    """``worker-2`` → (``worker``, 2); a name without a replica number is replica 1 of itself (the
    names deploy.launcher.replica_name gives)."""
    base, _, number = name.rpartition("-")
    return (base, int(number)) if base and number.isdigit() else (name, 1)


def _log_names(logs_dir: Path) -> list[str]:
    """The processes with a log, in start order, each kind's replicas after its first."""
    found = {p.stem: _replica(p.stem) for p in logs_dir.glob("*.log")}
    known = {
        name: (PROCESSES.index(kind), index) for name, (kind, index) in found.items() if kind in PROCESSES
    }
    return sorted(known, key=known.__getitem__)


@dataclass
class Target:
    url: str
    token: str
    token_from: str


def config_target(url: str | None, token: str | None, state_dir: str | None) -> Target:
    """The config service and admin token a command uses: ``--url``/``--token`` when given, else
    the running ``sie up``'s (its state directory's ``status.json`` and ``admin-token``). The
    token is only ever read, never created. Raises NoCluster with what to pass."""
    state: Path | None = None
    if url is None or (token is None and not os.environ.get("SIE_ADMIN_TOKEN")):
        try:
            state = find_state_dir(state_dir)
        except NoCluster as exc:
            if url is None:
                raise NoCluster(f"{exc}; or pass --url and --token of the config service") from None
    if url is None:
        assert state is not None
        url = str((read_status(state) or {}).get("config_url") or "")
        if not url:
            raise NoCluster(f"{state}/status.json names no config service URL: pass --url")
    if token is not None:
        return Target(url, token, "--token")
    if os.environ.get("SIE_ADMIN_TOKEN"):
        return Target(url, os.environ["SIE_ADMIN_TOKEN"], "SIE_ADMIN_TOKEN")
    path = state / "admin-token" if state is not None else None
    if path is None or not path.exists():
        raise NoCluster("no admin token: pass --token, set SIE_ADMIN_TOKEN, or --state-dir of the sie up")
    return Target(url, path.read_text().strip(), str(path))


def _request(target: Target, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
    """(status, body) of one admin call to the config service; status 0: it was not reached."""
    headers = {"Authorization": f"Bearer {target.token}"}
    if body is not None:
        headers["Content-Type"] = "application/x-yaml"
    req = urllib.request.Request(target.url.rstrip("/") + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, f"cannot reach the config service at {target.url}: {exc}"


def _answer(target: Target, status: int, body: str) -> int:
    """Print a 2xx body (0), or say what went wrong (1): a refused token names where it came from."""
    if 200 <= status < 300:
        print(body)
        return 0
    if status in (401, 403):
        return _fail(
            f"HTTP {status}: {body}\nthe config service at {target.url} refused the admin token "
            f"from {target.token_from}: pass this cluster's token with --token, or --state-dir of "
            "the sie up that runs it"
        )
    return _fail(f"HTTP {status}: {body}" if status else body)


def _target(url: str | None, token: str | None, state_dir: str | None) -> Target | int:
    try:
        return config_target(url, token, state_dir)
    except NoCluster as exc:
        return _fail(str(exc))


def _model_path(model_id: str) -> str:
    return "/v1/configs/models/" + urllib.parse.quote(model_id, safe="/:@")


def add_model(path: str, url: str | None, token: str | None, state_dir: str | None) -> int:
    """``sie models add FILE.yaml``: POST a model config to the config service with the admin token."""
    try:
        body = Path(path).read_bytes()
    except OSError as exc:
        return _fail(f"cannot read {path}: {exc.strerror}")
    target = _target(url, token, state_dir)
    if isinstance(target, int):
        return target
    return _answer(target, *_request(target, "POST", "/v1/configs/models", body))


def delete_model(model_id: str, url: str | None, token: str | None, state_dir: str | None) -> int:
    """``sie models delete ID``: DELETE the model's API config (absent: ``deleted: false``)."""
    target = _target(url, token, state_dir)
    if isinstance(target, int):
        return target
    return _answer(target, *_request(target, "DELETE", _model_path(model_id)))


def show_model(model_id: str, url: str | None, token: str | None, state_dir: str | None) -> int:
    """``sie models show ID``: the stored YAML of one model."""
    target = _target(url, token, state_dir)
    if isinstance(target, int):
        return target
    return _answer(target, *_request(target, "GET", _model_path(model_id)))


def list_models(url: str | None, token: str | None, state_dir: str | None) -> int:
    """``sie models list``: one line per model: id, where its weights are (from the cluster's
    gateway, protocol.weights), source (api | filesystem), profiles."""
    target = _target(url, token, state_dir)
    if isinstance(target, int):
        return target
    status, body = _request(target, "GET", "/v1/configs/models")
    if status != 200:
        return _answer(target, status, body)
    models = json.loads(body).get("models") or []
    # the gateway of the sie up whose config service this is (not when --url names another one)
    weights = _weights(state_dir) if url is None else None
    if weights is None and url is None:
        print("sie: WEIGHTS unknown: the cluster's gateway did not answer GET /v1/models", file=sys.stderr)
    width = max([len("MODEL")] + [len(m["model_id"]) for m in models])
    print(f"{'MODEL':<{width}}  {'WEIGHTS':<13}  {'SOURCE':<10}  PROFILES")
    for m in models:
        where = (weights or {}).get(m["model_id"], "unknown")
        profiles = ",".join(m.get("profiles") or [])
        print(f"{m['model_id']:<{width}}  {where:<13}  {m.get('source', ''):<10}  {profiles}")
    return 0


def _weights(state_dir: str | None) -> dict[str, str] | None:
    """Model id → where its weights are, from the running cluster's gateway; None when there is
    none or it does not answer."""
    try:
        state = find_state_dir(state_dir)
    except NoCluster:
        return None
    gateway = (read_status(state) or {}).get("gateway_url")
    if not gateway:
        return None
    try:
        with urllib.request.urlopen(str(gateway).rstrip("/") + "/v1/models", timeout=10) as resp:
            entries = json.loads(resp.read()).get("models") or []
    except (OSError, ValueError):
        return None
    return {
        e["name"]: str(e.get("weights") or "unknown") for e in entries if isinstance(e, dict) and "name" in e
    }
