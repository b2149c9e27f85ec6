"""``sie up`` as a user runs it: the whole cluster comes up, serves, and Ctrl-C stops every process."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import wait_for_worker
from tests.support.model_yaml import extends_default, fake_model
from tests.support.processes import Identity, identities, kill_if_same
from tests.support.sie_up import (
    FAST,
    REPO,
    SDK,
    cli,
    free_ports,
    launch,
    up_args,
    user_env,
    wait_readyz,
    wait_status_ready,
)
from worker import POD_OMP_PROC_BIND, POD_OMP_SPINCOUNT


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def _kill_all(proc: subprocess.Popen, children: set[Identity]) -> None:
    """Teardown whatever the test left: ``sie up`` itself and the children it had started (while
    they are still those processes: a pid may name another test's process by then)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    kill_if_same(children)


def test_sie_up_serves_through_the_gateway_and_stops_cleanly(tmp_path):
    ports = free_ports()
    # two intra-op threads, and none of the test's own OpenMP settings
    env = user_env(
        tmp_path / "xdg", {"SIE_TORCH_THREADS": "2", **FAST}, drop=("GOMP_SPINCOUNT", "OMP_PROC_BIND")
    )
    proc = launch(up_args(tmp_path / "state", ports), env)
    children: list[int] = []
    owned: set[Identity] = set()
    gateway = f"http://127.0.0.1:{ports['gw']}"
    try:
        wait_readyz(proc, gateway)
        children = _children(proc.pid)
        owned = identities(children)
        assert len(children) == 5  # nats-server, config service, worker, sidecar, gateway
        # the worker, and only the worker, runs with the pod's OpenMP spin count
        spin = {("worker.ipc" in _cmdline(p), _environ(p).get("GOMP_SPINCOUNT")) for p in children}
        assert spin == {(True, POD_OMP_SPINCOUNT), (False, None)}
        # and, the one worker (two intra-op threads) on a host without a GPU, bound: its helper threads
        # share the first core
        bind = {("worker.ipc" in _cmdline(p), _environ(p).get("OMP_PROC_BIND")) for p in children}
        on_cpu = not glob.glob("/dev/nvidia[0-9]*")
        assert bind == {(True, POD_OMP_PROC_BIND if on_cpu else None), (False, None)}
        health = wait_for_worker(gateway)
        assert health["type"] == "gateway"
        r = httpx.post(
            gateway + "/v1/encode/sie-fake",
            json={"items": [{"text": "up"}]},
            headers=SDK,
            timeout=60,
        )
        assert r.status_code == 200 and len(r.json()["items"][0]["dense"]["values"]) == 384
        # least privilege: the worker holds no token; the gateway its own pool-admin token, not the
        # config service's admin token; token files are this user's alone
        state = tmp_path / "state"
        tokens = {
            name: (state / name).read_text()
            for name in ("admin-token", "pool-admin-token", "config-read-token")
        }
        assert all(stat.S_IMODE((state / name).stat().st_mode) == 0o600 for name in tokens)
        by_module = {m: _environ(p) for p in children for m in ("worker.ipc", "gateway", "sidecar", "config_service")
                     if f"-m {m} " in _cmdline(p) + " "}  # fmt: skip
        assert set(by_module) == {"worker.ipc", "gateway", "sidecar", "config_service"}
        assert not set(tokens.values()) & set(by_module["worker.ipc"].values())
        assert by_module["gateway"]["SIE_ADMIN_TOKEN"] == tokens["pool-admin-token"]
        assert tokens["admin-token"] not in by_module["gateway"].values()
        assert by_module["sidecar"]["SIE_CONFIG_SERVICE_TOKEN"] == tokens["config-read-token"]
        assert by_module["config_service"]["SIE_ADMIN_TOKEN"] == tokens["admin-token"]
        pool = {"name": "up-pool", "gpus": {"cpu": 1}}
        assert httpx.post(gateway + "/v1/pools", json=pool, timeout=10).status_code == 401
        admin = {"Authorization": f"Bearer {tokens['pool-admin-token']}"}
        assert httpx.post(gateway + "/v1/pools", json=pool, headers=admin, timeout=10).status_code == 201
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)  # reads while it waits: a full pipe never stalls sie up
        assert proc.returncode == 0, out
        assert f"{state}/pool-admin-token" in out and f"{state}/admin-token" in out
        assert tokens["pool-admin-token"] not in out and tokens["admin-token"] not in out
        # each NATS client has a user of its own, and no password reaches a log or the output
        nats_passwords = {
            role: (state / "nats" / f"{role}-password").read_text()
            for role in ("gateway", "sidecar", "config")
        }
        assert f"gateway:{nats_passwords['gateway']}@" in by_module["gateway"]["SIE_NATS_URL"]
        assert f"sidecar:{nats_passwords['sidecar']}@" in by_module["sidecar"]["SIE_NATS_URL"]
        logs = "".join(p.read_text(errors="replace") for p in (state / "logs").glob("*.log")) + out
        assert "NATS nats://gateway:***@" in logs  # the gateway's start line, redacted
        assert not any(pw in logs for pw in nats_passwords.values())
        time.sleep(0.5)
        alive = [
            p
            for p in children
            if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()
        ]
        assert alive == [], f"processes left running: {alive}"
    finally:
        _kill_all(proc, owned)


SLOW_YAML = fake_model("acme/slow", profiles={"slow": extends_default(loadtime={"batch_delay_ms": 4000})})


def test_ctrl_c_answers_the_request_in_flight_and_stops_gateway_first(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) with a request in flight: the request the
    gateway holds is answered, not dropped, and the stop order is printed."""
    ports = free_ports()
    state = tmp_path / "state"
    env = user_env(tmp_path / "xdg", {"PYTHONPATH": str(REPO), **FAST})
    # its own process group, as a shell gives a foreground job: Ctrl-C is SIGINT to that group
    proc = launch(up_args(state, ports), env, own_session=True)
    gateway = f"http://127.0.0.1:{ports['gw']}"
    pids: list[int] = []
    owned: set[Identity] = set()
    result: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 120  # generous: only guards against a hang
        wait_status_ready(proc, state, deadline)
        pids = _children(proc.pid)
        owned = identities(pids)
        wait_for_worker(gateway)
        model = tmp_path / "slow.yaml"
        model.write_text(SLOW_YAML)
        added = subprocess.run(
            cli("models", "add", str(model), "--state-dir", str(state)),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert added.returncode == 0, added.stderr
        while True:  # the new model is routable and loaded (default profile, no delay)
            assert time.monotonic() < deadline
            with contextlib.suppress(httpx.HTTPError):
                if (
                    httpx.post(
                        gateway + "/v1/encode/acme/slow",
                        json={"items": [{"text": "w"}]},
                        headers=SDK,
                        timeout=30,
                    ).status_code
                    == 200
                ):
                    break
            time.sleep(0.3)

        def slow_request() -> None:
            try:
                r = httpx.post(
                    gateway + "/v1/encode/acme/slow:slow",
                    json={"items": [{"text": "in flight"}]},
                    headers=SDK,
                    timeout=60,
                )
                result["status"] = r.status_code
            except httpx.HTTPError as exc:
                result["error"] = repr(exc)

        thread = threading.Thread(target=slow_request)
        thread.start()
        worker_log = state / "logs" / "worker.log"
        while "(profile slow" not in worker_log.read_text(errors="replace"):  # it reached the worker
            assert time.monotonic() < deadline and thread.is_alive(), result
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        thread.join(90)
        out, _ = proc.communicate(timeout=90)  # reads while it waits: a full pipe never stalls sie up
        assert proc.returncode == 0, out
        assert result.get("status") in (200, 503), result  # answered, not a dropped connection
        print("in-flight request answered with", result["status"])
        order = [
            out.index(f"stopping {name} (pid") for name in ("gateway", "sidecar", "worker", "config", "nats")
        ]
        assert order == sorted(order), out
        assert "all processes stopped" in out
    finally:
        _kill_all(proc, owned)


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["terminal-closed", "kill-9"])
def test_sie_up_ending_otherwise_leaves_no_process_behind(tmp_path, sig):
    """The children have their own sessions, so they no longer get the terminal's SIGHUP: sie up
    stops them in order on SIGHUP, and a sie up killed outright takes them with it."""
    ports = free_ports()
    state = tmp_path / "state"
    proc = launch(up_args(state, ports), user_env(tmp_path / "xdg"), own_session=True)
    pids: list[int] = []
    owned: set[Identity] = set()
    try:
        deadline = time.monotonic() + 120  # generous: only guards against a hang
        wait_status_ready(proc, state, deadline)
        pids = _children(proc.pid)
        owned = identities(pids)
        assert len(pids) == 5
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=90)  # reads while it waits: a full pipe never stalls sie up
        deadline = time.monotonic() + 60  # generous: only guards against a hang
        if sig == signal.SIGHUP:
            assert (
                proc.returncode == 0 and "stopping gateway (pid" in out and "all processes stopped" in out
            ), out
        while [p for p in pids if _alive(p)]:
            assert time.monotonic() < deadline, f"left running: {[p for p in pids if _alive(p)]}"
            time.sleep(0.1)
    finally:
        _kill_all(proc, owned)
