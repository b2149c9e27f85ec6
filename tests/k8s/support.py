"""The one-node cluster that ``make k8s-up`` starts, seen from the tests (marker ``k8s``).

Everything goes through the cluster's own front doors: kubectl and helm with the kubeconfig
that ``make k8s-up`` printed, the gateway's node port on 127.0.0.1, the public sie-sdk 0.10.1
(Python 3.12 venv of ``tests/support/sdk312.py``) and our SDK.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.sdk312 import VENV as SDK_VENV

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("SIE_K8S_STATE", "/var/lib/sie-k8s"))
NAMESPACE = os.environ.get("SIE_K8S_NAMESPACE", "sie")
RELEASE = os.environ.get("SIE_K8S_RELEASE", "sie")
GATEWAY_URL = os.environ.get("SIE_K8S_GATEWAY_URL", "http://127.0.0.1:30080")
CHART = REPO / "helm" / "sie-cluster"
LOCAL_VALUES = REPO / "deploy" / "k8s-local" / "values.yaml"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
FAKE = "sie-fake"


@dataclass
class Cluster:
    kubeconfig: Path
    helm_bin: str
    namespace: str = NAMESPACE
    release: str = RELEASE
    gateway_url: str = GATEWAY_URL
    state: Path = STATE

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 600, stdin: str | None = None) -> str:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=self.env(), timeout=timeout, input=stdin
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def api_key(self) -> str:
        """The gateway's inference token, as an operator reads it from the auth Secret."""
        data = self.get("secret", f"{self.release}-auth")["data"]
        return base64.b64decode(data["SIE_AUTH_TOKENS"]).decode().split(",")[0].strip()

    def headers(self, **extra: str) -> dict[str, str]:
        """Headers of a plain HTTP call to the gateway: the bearer token, and ``extra``."""
        return {"Authorization": f"Bearer {self.api_key()}", **extra}

    def kubectl(self, *args: str, **kw) -> str:
        return self.run("kubectl", "-n", self.namespace, *args, **kw)

    def helm(self, *args: str, **kw) -> str:
        return self.run(self.helm_bin, "-n", self.namespace, *args, **kw)

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pods(self, selector: str = "") -> list[dict]:
        sel = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component!=test"
        return self.get("pods", "-l", sel + ("," + selector if selector else ""))["items"]

    def wait_ready(self, timeout_s: int = 600) -> None:
        """Every pod of the release Ready, none terminating, each controller at its replica count."""
        deadline = time.monotonic() + timeout_s
        while True:
            pods = self.pods()
            want = self._wanted_replicas()
            ready = [p for p in pods if _ready(p) and not p["metadata"].get("deletionTimestamp")]
            if len(ready) == len(pods) == want:
                return
            if time.monotonic() > deadline:
                table = self.kubectl("get", "pods", "-o", "wide", check=False)
                raise AssertionError(f"pods not Ready after {timeout_s} s ({len(ready)}/{want}):\n{table}")
            time.sleep(1)

    def _wanted_replicas(self) -> int:
        sel = f"app.kubernetes.io/instance={self.release}"
        total = 0
        for kind in ("deployments", "statefulsets"):
            for obj in self.get(kind, "-l", sel)["items"]:
                total += int(obj["spec"].get("replicas") or 0)
        return total

    def pod_names(self, component: str) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.pods(f"app.kubernetes.io/component={component}"))

    def container_id(self, pod: str, container: str) -> str:
        status = self.get("pod", pod)["status"]["containerStatuses"]
        cid = next(s["containerID"] for s in status if s["name"] == container)
        return cid.split("://", 1)[1]

    def restarts(self, pod: str, container: str) -> int:
        status = self.get("pod", pod)["status"]["containerStatuses"]
        return int(next(s["restartCount"] for s in status if s["name"] == container))

    def ctr(self, *args: str) -> str:
        sock = self.state / "ctrd" / "containerd.sock"
        return self.run("ctr", "-a", str(sock), "-n", "k8s.io", *args)


def _ready(pod: dict) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


# ---- load through the public sie-sdk ---------------------------------------------------------
LOAD_SCRIPT = """
import concurrent.futures, json, os, sys, threading, time
import numpy as np
from sie_sdk import SIEClient

URL, MODEL = os.environ["SIE_TEST_URL"], os.environ["SIE_LOAD_MODEL"]
TOTAL, THREADS = int(os.environ["SIE_LOAD_TOTAL"]), int(os.environ["SIE_LOAD_THREADS"])
PACE_S, SIGNAL_AT = float(os.environ["SIE_LOAD_PACE_S"]), int(os.environ["SIE_LOAD_SIGNAL_AT"])
UNTIL_STOP = TOTAL <= 0
TEXTS = [f"kubernetes fault text {i}" for i in range(16)]
with SIEClient(URL) as c:
    refs = {t: np.asarray(c.encode(MODEL, {"text": t}, provision_timeout_s=300)["dense"]) for t in TEXTS}
stop = threading.Event()
lock = threading.Lock()
state = {"next": 0, "done": 0}
def take():
    with lock:
        if stop.is_set() or (not UNTIL_STOP and state["next"] >= TOTAL):
            return None
        state["next"] += 1
        return state["next"] - 1
def finished():
    with lock:
        state["done"] += 1
        if state["done"] == SIGNAL_AT:
            print("SIGNAL", flush=True)
def worker(k):
    out = []
    with SIEClient(URL) as cc:
        while (i := take()) is not None:
            text = TEXTS[i % len(TEXTS)]
            start = time.time()
            try:
                r = cc.encode(MODEL, {"text": text}, provision_timeout_s=300)
                v, ref = np.asarray(r["dense"]), refs[text]
                # in bf16 (SIE_CPU_PRECISION=auto) another batch rounds differently: direction, not bits
                ok = float(v @ ref) / float(np.linalg.norm(v) * np.linalg.norm(ref)) >= 0.9999
                out.append((start, time.time(), "ok" if ok else "wrong"))
            except Exception as exc:
                out.append((start, time.time(), f"error: {type(exc).__name__}: {exc}"[:300]))
            finished()
            time.sleep(PACE_S)
    return out
if UNTIL_STOP:
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("STARTED", flush=True)
with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
    results = [r for rs in pool.map(worker, range(THREADS)) for r in rs]
print("RESULT " + json.dumps(results), flush=True)
"""


@dataclass
class LoadResult:
    results: list[tuple[float, float, str]]
    signalled_at: float | None
    acted_at: float | None = None
    stderr: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(r[2].startswith("error") for r in self.results)

    @property
    def wrong(self) -> int:
        return sum(r[2] == "wrong" for r in self.results)

    @property
    def longest_s(self) -> float:
        return max(r[1] - r[0] for r in self.results)

    def spans(self, at: float) -> bool:
        """Some requests finished before ``at`` and some started after it: the event fell mid-run."""
        return any(r[1] < at for r in self.results) and any(r[0] > at for r in self.results)

    def summary(self) -> str:
        return (
            f"{len(self.results)} requests, failed {self.failed}, wrong vectors {self.wrong}, "
            f"longest {self.longest_s:.1f} s"
        )


def run_load(
    url: str,
    action,
    *,
    total: int = 200,
    threads: int = 4,
    pace_s: float = 0.2,
    signal_at: int = 40,
    model: str = MINILM,
    timeout_s: float = 900,
) -> LoadResult:
    """Public-SDK load (``total`` encodes from ``threads`` threads; 0 = until ``action`` returns);
    ``action()`` runs once ``signal_at`` requests have completed, while the load goes on."""
    env = {
        **os.environ,
        "SIE_TEST_URL": url,
        "SIE_LOAD_MODEL": model,
        "SIE_LOAD_TOTAL": str(total),
        "SIE_LOAD_THREADS": str(threads),
        "SIE_LOAD_PACE_S": str(pace_s),
        "SIE_LOAD_SIGNAL_AT": str(signal_at),
    }
    proc = subprocess.Popen(
        [str(SDK_VENV / "bin" / "python"), "-c", textwrap.dedent(LOAD_SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    err: list[str] = []
    reader = threading.Thread(
        target=lambda: err.append(proc.stderr.read() if proc.stderr else ""), daemon=True
    )
    reader.start()
    out = LoadResult(results=[], signalled_at=None)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            if line.startswith("SIGNAL"):
                out.signalled_at = time.time()
                action()
                out.acted_at = time.time()
                if total <= 0:
                    proc.stdin.write("stop\n")
                    proc.stdin.flush()
            elif line.startswith("RESULT "):
                out.results = [tuple(r) for r in json.loads(line[len("RESULT ") :])]
        proc.wait(timeout=60)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    out.stderr = "".join(err)
    if not out.results:
        raise AssertionError(f"the load script gave no results (rc {proc.returncode}):\n{out.stderr[-3000:]}")
    out.errors = sorted({r[2] for r in out.results if r[2] != "ok"})[:5]
    return out


def log(msg: str) -> None:
    print(f"[k8s {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
