"""Where the cluster path's time goes: CPU per request of each process, and how long each waited
for a CPU, beside ``sie serve`` on the same load.

``python -m tests.benchmarks.path_cpu`` starts ``sie serve`` and one ``sie up`` cluster (the
launcher's, with ``--model-processes`` and ``--worker-cpus`` as ``sie up`` takes them) and drives
the same closed-loop load (``--per`` items per request × ``--clients``, default the zero-cost
``sie-fake`` at 32 × 8) through each in turn, ``--rounds`` times, the order flipping every round.
For every slice it prints the rate and p50, then per process (and for the benchmark's own
clients): milliseconds of CPU per request, and from ``/proc/<pid>/task/*/schedstat`` the share of
the slice its threads ran and the share they waited runnable for a CPU; then what the host's
cores did (``/proc/stat``). A process that waits for a CPU about as long as it runs, on a host
with idle cores, is paced by how the scheduler wakes it, not by its own work. With
``--per-thread``, each busy thread of every process too: the share of a core it ran and waited,
how many times it ran per request, and how long it waited each time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.launcher import Cluster
from tests.benchmarks.load import run_load
from tests.benchmarks.run import OFF, sentences
from tests.support.nats_server import free_port
from tests.support.processes import descendants
from tests.support.serve import ServeProcess

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Sched:
    """A process's threads together: CPU seconds, and seconds run and waited runnable (schedstat)."""

    cpu_s: float = 0.0
    run_s: float = 0.0
    wait_s: float = 0.0

    def __sub__(self, other: Sched) -> Sched:
        return Sched(self.cpu_s - other.cpu_s, self.run_s - other.run_s, self.wait_s - other.wait_s)


@dataclass
class ThreadSched:
    """One thread: its name, its CPU seconds (``stat``), and nanoseconds run and waited runnable and
    how many times it ran (the three fields of its ``schedstat``)."""

    name: str
    cpu_s: float
    run_ns: int
    wait_ns: int
    slices: int


def threads_of(pid: int, *, tree: bool = True) -> dict[tuple[int, int], ThreadSched]:
    """Each thread of ``pid`` (with ``tree``, of its descendants too), keyed by (process, thread)
    id; threads that ended are gone, so a slice measures long-lived processes only."""
    out: dict[tuple[int, int], ThreadSched] = {}
    for p in descendants(pid) if tree else [pid]:
        for tid in _listdir(f"/proc/{p}/task"):
            schedstat = _read(f"/proc/{p}/task/{tid}/schedstat").split()
            stat = _read(f"/proc/{p}/task/{tid}/stat")
            if len(schedstat) != 3 or not stat:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / TICK
            out[(p, int(tid))] = ThreadSched(name, cpu_s, *(int(x) for x in schedstat))
    return out


def sched_of(pid: int, *, tree: bool = True) -> Sched:
    """``pid``'s threads (with ``tree``, its descendants' too) as one :class:`Sched`."""
    threads = threads_of(pid, tree=tree).values()
    return Sched(
        sum(t.cpu_s for t in threads),
        sum(t.run_ns for t in threads) / 1e9,
        sum(t.wait_ns for t in threads) / 1e9,
    )


def thread_lines(
    before: dict[tuple[int, int], ThreadSched],
    after: dict[tuple[int, int], ThreadSched],
    elapsed: float,
    requests: float,
) -> list[str]:
    """A line for each thread that ran or waited at least 1 % of a core in the slice: the share of
    a core it ran and waited, how often it ran per request, and its mean wait each time."""
    lines = []
    for key, a in after.items():
        b = before.get(key, ThreadSched(a.name, 0.0, 0, 0, 0))
        run_s, wait_s, slices = (
            (a.run_ns - b.run_ns) / 1e9,
            (a.wait_ns - b.wait_ns) / 1e9,
            a.slices - b.slices,
        )
        if max(run_s, wait_s) < 0.01 * elapsed:
            continue
        lines.append(
            f"      {a.name:16} ran {run_s / elapsed:4.2f}  waited {wait_s / elapsed:4.2f} (cores);"
            f" {slices / requests:4.1f} runs/request, {wait_s * 1e6 / max(1, slices):5.0f} us waited a run"
        )
    return lines


def _read(path: str) -> str:
    """The text of a /proc file; empty when its process or thread has ended."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def host_cores() -> list[int]:
    """The ``cpu`` line of ``/proc/stat``: user, nice, system, idle, iowait, irq, softirq, steal."""
    return [int(x) for x in _read("/proc/stat").splitlines()[0].split()[1:9]]


def measure(
    url: str, headers: dict[str, str] | None, pids: dict[str, int], args: argparse.Namespace, texts: list[str]
) -> list[str]:
    """One slice of load on ``url``: its lines (rate, then each process, then the host)."""
    me = os.getpid()  # the clients: this process alone, not the servers it started

    def snapshot() -> dict[str, Sched]:
        return {name: sched_of(pid, tree=pid != me) for name, pid in pids.items()}

    servers = {name: pid for name, pid in pids.items() if pid != me}
    before = snapshot()
    threads0 = {name: threads_of(pid) for name, pid in servers.items()} if args.per_thread else {}
    host0, t0 = host_cores(), time.perf_counter()
    rate, p50, _ = run_load(
        url, texts, args.per, args.clients, args.seconds, model=args.model, extra_headers=headers
    )
    elapsed = time.perf_counter() - t0
    host1 = host_cores()
    threads1 = {name: threads_of(pid) for name, pid in servers.items()} if args.per_thread else {}
    after = snapshot()
    requests = rate * elapsed / args.per
    lines = [f"  {rate:9.0f} items/s, p50 {p50:6.1f} ms"]
    for name in pids:
        d = after[name] - before[name]
        lines.append(
            f"    {name:10} {d.cpu_s * 1000 / requests:6.2f} ms CPU/request  ran {d.run_s / elapsed:4.2f}"
            f"  waited for a CPU {d.wait_s / elapsed:4.2f} (cores)"
        )
        if name in threads1:
            lines += thread_lines(threads0[name], threads1[name], elapsed, requests)
    user, nice, system, idle, iowait, irq, softirq, steal = (
        (b - a) / TICK / elapsed for a, b in zip(host0, host1, strict=True)
    )
    lines.append(
        f"    host: user {user + nice:4.2f} system {system + irq + softirq:4.2f} idle {idle + iowait:4.2f}"
        f" steal {steal:4.2f} (cores)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sie-fake")
    ap.add_argument("--per", type=int, default=32, help="items per request")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0, help="per slice")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of sie serve and the worker")
    ap.add_argument("--model-processes", type=int, default=1)
    ap.add_argument("--worker-cpus", type=int, default=0)
    ap.add_argument(
        "--per-thread", action="store_true", help="also each busy thread of every process, from its schedstat"
    )
    args = ap.parse_args(argv)
    threads = str(args.threads)
    os.environ.update({"SIE_TORCH_THREADS": threads, "OMP_NUM_THREADS": threads, "SIE_HF_OFFLINE": "1"})
    texts = sentences(512, 32, 1)
    with (
        tempfile.TemporaryDirectory(prefix="sie-bench-path-") as tmp,
        ServeProcess(env={"SIE_TORCH_THREADS": threads, "SIE_PRELOAD_MODELS": args.model}) as server,
    ):
        cluster = Cluster(
            state_dir=Path(tmp),
            gateway_port=free_port(),
            config_port=free_port(),
            nats_port=free_port(),
            preload=args.model,
            model_processes=args.model_processes,
            worker_cpus=args.worker_cpus,
        )
        try:
            cluster.start(say=lambda line: None)
            split = cluster.cpu_split()
            if split is not None:  # the clients beside the cluster's other processes
                os.sched_setaffinity(0, split[1])
            assert server.proc is not None
            doors = {
                "sie serve": (server.url, None, {"serve": server.proc.pid}),
                "cluster": (cluster.gateway_url, OFF, {name: proc.pid for name, proc in cluster.procs}),
            }
            for url, headers, _ in doors.values():  # warm-up: shapes, connections
                run_load(url, texts, args.per, args.clients, 2.0, model=args.model, extra_headers=headers)
            print(
                f"{args.model}, {args.per}/req x {args.clients} clients, {args.seconds:.0f} s slices",
                flush=True,
            )
            for rnd in range(args.rounds):
                order = list(doors) if rnd % 2 == 0 else list(doors)[::-1]
                for name in order:
                    url, headers, pids = doors[name]
                    lines = measure(url, headers, {**pids, "clients": os.getpid()}, args, texts)
                    print(f"round {rnd + 1}, {name}:", *lines, sep="\n", flush=True)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
