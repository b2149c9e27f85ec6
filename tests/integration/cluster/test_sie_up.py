"""``sie up`` as a user runs it: the whole cluster comes up, serves, and Ctrl-C stops every process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.cluster import wait_for_worker
from tests.support.nats_server import free_port

REPO = Path(__file__).resolve().parents[3]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_sie_up_serves_through_the_gateway_and_stops_cleanly(tmp_path):
    ports = {"gw": free_port(), "cfg": free_port(), "nats": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIE_")}
    env.update({"SIE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "SIE_TORCH_THREADS": "1",
                "SIE_HEALTH_PUBLISH_INTERVAL_MS": "1000", "SIE_GATEWAY_WORKER_WARMUP_S": "1"})
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--port", str(ports["gw"]), "--config-port", str(ports["cfg"]),
           "--nats-port", str(ports["nats"]), "--state-dir", str(tmp_path / "state"), "--preload", "sie-fake"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    gateway = f"http://127.0.0.1:{ports['gw']}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(gateway + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        children = _children(proc.pid)
        assert len(children) == 5  # nats-server, config service, worker, sidecar, gateway
        health = wait_for_worker(gateway)
        assert health["type"] == "gateway"
        r = httpx.post(gateway + "/v1/encode/sie-fake", json={"items": [{"text": "up"}]},
                       headers={"Accept": "application/json", "X-SIE-SDK-Version": "0.10.1"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["items"][0]["dense"]["values"]) == 384
        assert (tmp_path / "state" / "admin-token").exists()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        alive = [p for p in children if Path(f"/proc/{p}").exists()
                 and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()]
        assert alive == [], f"processes left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
