"""The ``sie`` CLI around a running cluster, run as a user runs it (issue 14): ``sie up --detach``,
a second ``sie up`` refused before it touches anything, ``status``/``logs``/``models add`` from a
directory outside the checkout that find the cluster by themselves, and ``sie down``."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import wait_for_worker
from tests.support.model_yaml import fake_model
from tests.support.processes import Identity, ctrl_c_at_default, identities, kill_if_same
from tests.support.sie_up import FAST, REPO, cli, free_ports, up_args, user_env

ALL = ("nats", "config", "worker", "sidecar", "gateway")

FAKE_YAML = fake_model("acme/cli-fake")


class User:
    """Runs ``sie …`` from ``cwd`` (not the checkout) with its own XDG state home."""

    def __init__(self, root: Path) -> None:
        self.cwd = root / "elsewhere"
        self.cwd.mkdir()
        self.env = user_env(root / "xdg", {"PYTHONPATH": str(REPO), **FAST})

    def run(self, *args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            cli(*args),
            cwd=self.cwd,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )


class Detached:
    def __init__(self, root: Path) -> None:
        self.user = User(root)
        self.state = root / "state"
        self.ports = free_ports()
        self.gateway = f"http://127.0.0.1:{self.ports['gw']}"
        self.config = f"http://127.0.0.1:{self.ports['cfg']}"

    def pids(self) -> list[int]:
        doc = json.loads((self.state / "status.json").read_text())
        return [doc["supervisor_pid"], *(c["pid"] for c in doc["children"] if c["pid"])]


@pytest.fixture(scope="module")
def detached(tmp_path_factory):
    d = Detached(Path(tmp_path_factory.mktemp("sie-cli")))
    started = d.user.run(*up_args(d.state, d.ports), "--detach")
    owned: set[Identity] = set()
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"sie-cluster is up: point a client at {d.gateway}" in started.stdout
        d.started = started
        owned = identities(d.pids())
        wait_for_worker(d.gateway)
        yield d
    finally:
        kill_if_same(owned)  # what is still that sie up's: a pid may name another test's process by now


def test_a_second_sie_up_on_the_same_ports_says_so_and_touches_nothing(detached, tmp_path):
    logs = {n: (detached.state / "logs" / f"{n}.log").stat().st_size for n in ALL}
    other = tmp_path / "other-state"
    second = detached.user.run(*up_args(other, detached.ports), timeout=60)
    assert second.returncode == 1
    assert f"port {detached.ports['gw']} is in use (another sie up?)" in second.stderr, second.stderr
    assert "sie-cluster is up" not in second.stdout
    assert not other.exists()  # nothing created, no nats-server started on another store
    assert {n: (detached.state / "logs" / f"{n}.log").stat().st_size for n in ALL} == logs
    # the same state directory on free ports: refused because that directory's sie up runs
    fresh = free_ports()
    third = detached.user.run(*up_args(detached.state, fresh), timeout=60)
    assert third.returncode == 1 and "belongs to a running sie up" in third.stderr, third.stderr
    assert {n: (detached.state / "logs" / f"{n}.log").stat().st_size for n in ALL} == logs


def test_status_and_logs_find_the_cluster_from_another_directory(detached):
    st = detached.user.run("status")
    assert st.returncode == 0, st.stdout + st.stderr
    processes, models = st.stdout.split("\n\n", 1)
    assert {ln.split()[0] for ln in processes.splitlines()[2:]} == set(ALL)
    # the models the workers hold, from the gateway: the preloaded sie-fake, loaded on one worker
    assert models.splitlines()[0].split() == ["MODEL", "STATE", "WORKERS", "LAST", "ERROR"], st.stdout
    assert ["sie-fake", "loaded", "1"] in [ln.split() for ln in models.splitlines()[1:]], st.stdout
    # and sie up's own output showed the load with its time
    up_log = (detached.state / "logs" / "sie-up.log").read_text()
    assert re.search(r"worker +loading sie-fake… done in [0-9.]+ s", up_log), up_log
    gw = detached.user.run("logs", "gateway")
    assert gw.returncode == 0 and f"listening on 127.0.0.1:{detached.ports['gw']}" in gw.stdout, gw.stderr
    every = detached.user.run("logs")
    assert every.returncode == 0
    assert {ln.split("|")[0].strip() for ln in every.stdout.splitlines()} == set(ALL)
    bad = detached.user.run("logs", "gatway")
    assert bad.returncode == 1 and "unknown process 'gatway': one of nats, config" in bad.stderr


def test_the_commands_sie_up_prints_run_as_printed(detached):
    """Issue 36: the hints name a sie that runs from where the user is (here, a directory outside
    the checkout), whether or not the venv's bin/ is on PATH."""
    hint = re.search(r"\(`(.+?) status`, `(.+?) logs -f`, `(.+?) down`\)", detached.started.stdout)
    assert hint and len(set(hint.groups())) == 1, detached.started.stdout
    st = subprocess.run(
        [*shlex.split(hint.group(1)), "status"],
        cwd=detached.user.cwd,
        env=detached.user.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert st.returncode == 0 and "running" in st.stdout, st.stdout + st.stderr


def test_models_add_from_another_directory_uses_the_running_clusters_token(detached, tmp_path):
    path = tmp_path / "fake.yaml"
    path.write_text(FAKE_YAML)
    ok = detached.user.run("models", "add", str(path))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["model_id"] == "acme/cli-fake"
    wrong = detached.user.run("models", "add", str(path), "--token", "not-the-token")
    assert wrong.returncode == 1
    assert "HTTP 403" in wrong.stderr and "refused the admin token from --token" in wrong.stderr
    # a user with no sie up on record: told what to pass, and no stray token is created
    lost = detached.user.run("models", "add", str(path), XDG_STATE_HOME=str(tmp_path / "empty"))
    assert lost.returncode == 1 and "no sie up found" in lost.stderr and "--state-dir" in lost.stderr
    assert not (detached.user.cwd / ".sie-state").exists()


def test_models_list_and_the_gateway_say_where_the_weights_are(detached):
    """Issue 36: offline, the listing tells the models that can load from the hub-only ones; the
    gateway learns it from the workers' heartbeats."""
    while True:  # until the first heartbeat with the worker's check of the weights (test timeout bounds it)
        listed = httpx.get(f"{detached.gateway}/v1/models", timeout=30).json()["models"]
        models = {m["name"]: m for m in listed}
        if models["sie-fake"]["weights"] != "unknown":
            break
        time.sleep(0.2)
    assert models["sie-fake"]["weights"] == "cached"
    assert models["sentence-transformers/all-MiniLM-L6-v2"]["weights"] == "cached"  # a pip package's
    assert models["BAAI/bge-m3"]["weights"] == "missing" and models["BAAI/bge-m3"]["state"] == "available"
    out = detached.user.run("models", "list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "WEIGHTS", "SOURCE", "PROFILES"]
    weights = {ln.split()[0]: ln.split()[1] for ln in lines[1:]}
    assert weights["sie-fake"] == "cached" and weights["BAAI/bge-m3"] == "missing", out.stdout


def test_sie_down_stops_the_cluster_gateway_first(detached):
    pids = detached.pids()
    follow = subprocess.Popen(
        cli("logs", "gateway", "-f"),
        cwd=detached.user.cwd,
        env=detached.user.env,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_at_default,
    )
    try:
        down = detached.user.run("down")
        assert down.returncode == 0, down.stderr
        assert "sie-cluster is down" in down.stdout
        # `logs -f` printed what the gateway appended while it stopped
        seen = []
        for line in follow.stdout:  # the gateway's last line arrives; the read cannot hang past it
            seen.append(line)
            if "gateway shutting down" in line:
                break
        assert any("gateway shutting down" in ln for ln in seen)
    finally:
        follow.send_signal(signal.SIGINT)
        follow.communicate(timeout=30)  # drains what it still prints: a full pipe would hold its exit
    said = (detached.state / "logs" / "sie-up.log").read_text()
    order = [said.index(f"stopping {name} (pid") for name in reversed(ALL)]
    assert order == sorted(order), said
    gone = [
        p
        for p in pids
        if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()
    ]
    assert gone == [], f"still running: {gone}"
    st = detached.user.run("status")
    assert st.returncode == 1 and "not running" in st.stdout
    again = detached.user.run("down")
    assert again.returncode == 1 and "no sie up is running" in again.stderr
