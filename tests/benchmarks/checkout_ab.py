"""A/B of two checkouts of this repository: one ``sie up`` cluster each, run at once, the same load
in alternating short slices.

``python -m tests.benchmarks.checkout_ab --base /tmp/base`` starts a cluster from the checkout at
``--base`` (``git worktree add /tmp/base <rev>`` makes one) and one from this checkout, both with
this virtual environment, then drives the same closed-loop load (``--per`` items per request ×
``--clients``, ``--model``, default the zero-cost ``sie-fake``) through one and then the other in
``--slices`` alternating slices of ``--slice-s`` seconds per round (the order flips from slice to
slice and round to round). Both clusters stay up the whole run and idle while the other is loaded,
so a host that speeds up or slows down from minute to minute weighs on both alike: on the shared
2-vCPU host two separate runs of the same code differ by 10-15%, which hides a change of a few
percent that this shows. An A/A run (``--base .``) shows the harness's own spread. Rates of 1 s
slices are lower than those of long runs (each slice opens its connections and ramps up).

Each round also prints, per checkout, the milliseconds of CPU per request of each kind of process
(``gateway``, ``nats``, ``sidecar``, ``worker``, from ``/proc``) and ``path``: gateway + nats +
sidecar, what the cluster spends beyond the worker (the issue-57 ``path_cpu``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.benchmarks.load import run_load
from tests.benchmarks.path_cpu import sched_of
from tests.benchmarks.run import OFF, sentences
from tests.support.nats_server import free_port
from tests.support.processes import descendants

HERE = Path(__file__).resolve().parents[2]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


ROLES = {"nats-server": "nats", "gateway": "gateway", "sidecar": "sidecar", "worker.ipc": "worker"}
PATH_ROLES = ("gateway", "nats", "sidecar")


def role_of(pid: int) -> str | None:
    """What a child of ``sie up`` is, from its command line (None: config service, the launcher)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in argv]
    if words and words[0].endswith("nats-server"):
        return "nats"
    if "-m" in words[:-1]:
        return ROLES.get(words[words.index("-m") + 1])
    return None


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of the processes under ``root`` (a ``sie up``), summed per role."""
    out: dict[str, float] = dict.fromkeys([*PATH_ROLES, "worker"], 0.0)
    for pid in descendants(root):
        role = role_of(pid)
        if role is not None:
            out[role] += sched_of(pid, tree=False).cpu_s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout (a directory of this repository)")
    ap.add_argument("--model", default="sie-fake")
    ap.add_argument("--per", type=int, default=1, help="items per request")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slices", type=int, default=8, help="slices per checkout and round")
    ap.add_argument("--slice-s", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every worker")
    args = ap.parse_args(argv)
    roots = {"base": Path(args.base).resolve(), "this": HERE}
    env = {
        **os.environ,
        "SIE_TORCH_THREADS": str(args.threads),
        "OMP_NUM_THREADS": str(args.threads),
        "SIE_HF_OFFLINE": "1",
    }
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    texts = sentences(512, 32, seed=1)

    def load(url: str, seconds: float) -> float:
        return run_load(url, texts, args.per, args.clients, seconds, model=args.model, extra_headers=OFF)[0]

    def measured(name: str, seconds: float) -> tuple[float, dict[str, float], float]:
        """A slice on ``name``'s cluster: items/s, CPU seconds per role, and its requests."""
        before, t0 = cpu_by_role(procs[name].pid), time.perf_counter()
        rate = load(urls[name], seconds)
        elapsed, after = time.perf_counter() - t0, cpu_by_role(procs[name].pid)
        return rate, {r: after[r] - before[r] for r in after}, rate * elapsed / args.per

    with tempfile.TemporaryDirectory(prefix="sie-bench-checkouts-") as tmp:
        try:
            for name, root in roots.items():
                port = free_port()
                log = Path(tmp, f"{name}.log").open("w")  # noqa: SIM115 - the child writes it till the end
                # run from the checkout: `python -m` puts it first on the path of every child
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "deploy.cli", "up", "--port", str(port), "--config-port",
                     str(free_port()), "--nats-port", str(free_port()), "--preload", args.model,
                     "--state-dir", f"{tmp}/{name}"],
                    cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
                urls[name] = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while not all(_ready(u) for u in urls.values()):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                    raise SystemExit(f"a cluster did not come up; logs in {tmp}")
                time.sleep(1)
            for url in urls.values():  # warm-up
                load(url, 3.0)
            print(
                f"base = {roots['base']}, this = {roots['this']}; {args.model}, {args.per}/req x {args.clients} "
                f"clients, {args.rounds} rounds x {args.slices} slices of {args.slice_s:g} s each (requests/s)",
                flush=True,
            )
            ratios, path_ratios = [], []
            for rnd in range(args.rounds):
                rates: dict[str, list[float]] = {"base": [], "this": []}
                cpu = {name: dict.fromkeys([*PATH_ROLES, "worker"], 0.0) for name in roots}
                requests = dict.fromkeys(roots, 0.0)
                order = ["base", "this"] if rnd % 2 == 0 else ["this", "base"]
                for _ in range(args.slices):
                    for name in order:
                        rate, used, done = measured(name, args.slice_s)
                        rates[name].append(rate)
                        requests[name] += done
                        for role, seconds in used.items():
                            cpu[name][role] += seconds
                    order.reverse()
                b, t = statistics.mean(rates["base"]), statistics.mean(rates["this"])
                ratios.append(t / b)
                per = {
                    name: {r: s * 1000 / max(requests[name], 1.0) for r, s in cpu[name].items()}
                    for name in roots
                }
                path = {name: sum(per[name][r] for r in PATH_ROLES) for name in roots}
                path_ratios.append(path["this"] / path["base"])
                print(f"round {rnd + 1}: base {b:8.1f}  this {t:8.1f}  this/base {t / b:.3f}", flush=True)
                for name in roots:
                    roles = "  ".join(f"{r} {per[name][r]:5.2f}" for r in (*PATH_ROLES, "worker"))
                    print(f"    {name:4} ms CPU/request: {roles}  path {path[name]:5.2f}", flush=True)
                print(f"    path this/base {path['this'] / path['base']:.3f}", flush=True)
            print(
                f"this/base: mean {statistics.mean(ratios):.3f}, lowest {min(ratios):.3f}, "
                f"highest {max(ratios):.3f}; path CPU per request this/base: mean "
                f"{statistics.mean(path_ratios):.3f}, lowest {min(path_ratios):.3f}, highest {max(path_ratios):.3f}"
            )
        finally:
            for p in procs.values():
                p.send_signal(2)
            for p in procs.values():
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
