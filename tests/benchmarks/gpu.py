"""GPU benchmark: ``python -m tests.benchmarks.gpu`` (``make bench-gpu``) prints one table.

Needs a CUDA device and a CUDA build of torch; elsewhere it prints why it skipped and exits 0.
Nothing comes from a hub: it builds two random-weight encoders on the spot — bge-base-sized (12
layers, hidden 768) and MiniLM-sized (6 layers, hidden 384) — with a WordPiece tokenizer whose
words are each one token, so every text has an exact token count. Then, in one run:

- the ceiling: a measured 8192³ bf16 matmul rate (TFLOP/s); MFU = useful FLOPs / that rate;
- in-process baselines on the same inputs: transformers (padded, SDPA) and our packed forward;
- ``sie serve`` on CUDA (bf16), clients in separate processes on the same host: 512-token,
  mixed 8–512, 32-token at 1 and 32 texts per request, msgpack and JSON;
- the same rows through the cluster as deployed (``sie up``'s launcher as it runs on this host: NATS,
  its gateways, one worker pod per GPU with its model processes, each a worker with a sidecar of its
  own, as the chart deploys them; ``--cluster-pods`` for other shapes);
- correctness: min cosine of served bf16 vectors against an fp32 transformers reference.

Every round is printed (a stall must show), then the table of medians with GPU utilisation. Each
round's line also says where the host's CPU went (cores used by each group of processes: the load
clients, ``sie serve``'s processes; the cluster's gateways, NATS, sidecars and workers) and, for the
cluster, how busy its workers' forwards were and their forward time per item (from each pod's
``/metrics``): what a cluster row that trails ``sie serve`` is waiting on.

``--smoke`` runs the whole script on the CPU with tiny random models, one short round and small
client counts: it checks the script end to end where no GPU is (its figures mean nothing), so a
GPU lease is not spent finding a broken benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protocol.codec import packb, unpackb
from tests.support.processes import descendants
from tests.support.serve import ServeProcess

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SHAPES = {  # name: (layers, hidden, heads, intermediate)
    "bge-base": (12, 768, 12, 3072),
    "minilm": (6, 384, 12, 1536),
}
#: where the in-process baselines and the served models run: "cuda", or "cpu" for --smoke
DEVICE = "cuda"


# ---- models and inputs -----------------------------------------------------------------------
@functools.cache
def vocabulary(size: int = 30522) -> list[str]:
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < size - len(SPECIALS):
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
    return SPECIALS + sorted(words)


def build_models(root: Path) -> Path:
    """Random-weight checkpoints, their tokenizer and model YAMLs; returns the models dir."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = vocabulary()
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(root / "vocab.txt"), do_lower_case=True)
    models = root / "models"
    models.mkdir()
    for name, (layers, hidden, heads, inter) in SHAPES.items():
        dest = root / name
        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=len(vocab),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=inter,
            max_position_embeddings=512,
        )
        BertModel(cfg).save_pretrained(str(dest))
        tok.save_pretrained(str(dest))
        (models / f"{name}.yaml").write_text(
            json.dumps(
                {
                    "sie_id": f"bench/{name}",
                    "weights_path": str(dest),
                    "inputs": {"text": True},
                    "tasks": {"encode": {"dense": {"dim": hidden}}},
                    "max_sequence_length": 512,
                    "profiles": {
                        "default": {
                            "adapter_path": "worker.adapters.dense:DenseAdapter",
                            "max_batch_tokens": 32768,
                            "compute_precision": "bfloat16",
                            "adapter_options": {"runtime": {"pooling": "mean", "normalize": True}},
                        },
                        "fp32": {"extends": "default", "compute_precision": "float32"},
                    },
                }
            )
        )
    return models


def texts_of(lengths: list[int], seed: int) -> list[str]:
    """Texts of exactly ``length`` tokens each ([CLS] and [SEP] included)."""
    words = vocabulary()[len(SPECIALS) :]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(n - 2)) for n in lengths]


def flops_per_seq(shape: tuple[int, int, int, int], length: int) -> float:
    """Forward FLOPs of one sequence: the linear layers plus the two attention matmuls."""
    layers, hidden, _, inter = shape
    return layers * (2 * length * (4 * hidden * hidden + 2 * hidden * inter) + 4 * length * length * hidden)


@dataclass
class Workload:
    name: str
    model: str
    lengths: list[int]
    per_request: int
    clients: int
    json: bool = False
    texts: list[str] = field(default_factory=list)

    def flops(self) -> float:
        shape = SHAPES[self.model]
        return statistics.fmean(flops_per_seq(shape, n) for n in self.lengths)


def workloads() -> list[Workload]:
    rng = random.Random(3)
    mixed = [rng.randint(8, 512) for _ in range(2048)]
    ws = [
        Workload("512 tok, 32/req x 16 clients", "bge-base", [512] * 512, 32, 16),
        Workload("mixed 8-512, 32/req x 16 clients", "bge-base", mixed, 32, 16),
        Workload("32 tok, 1/req x 64 clients", "bge-base", [32] * 2048, 1, 64),
        Workload("32 tok, 32/req x 16 clients", "bge-base", [32] * 2048, 32, 16),
        Workload("512 tok, 32/req x 16 clients, JSON", "bge-base", [512] * 512, 32, 16, json=True),
        Workload("MiniLM 512 tok, 32/req x 16 clients", "minilm", [512] * 512, 32, 16),
        Workload("MiniLM 32 tok, 1/req x 64 clients", "minilm", [32] * 2048, 1, 64),
    ]
    for i, w in enumerate(ws):
        w.texts = texts_of(w.lengths, seed=100 + i)
    return ws


# ---- load generation (separate processes: one Python client cannot drive thousands of req/s) ---
def _client_proc(
    url: str,
    model: str,
    texts: list[str],
    per_request: int,
    clients: int,
    seconds: float,
    use_json: bool,
    offset: int,
) -> list[float]:
    import aiohttp

    async def run() -> list[float]:
        lat: list[float] = []
        stop = time.perf_counter() + seconds
        if use_json:
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
        else:
            headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        headers["X-SIE-Cache"] = (
            "off"  # the gateway's result cache (off by default) must not answer repeated texts
        )

        async def one(session: aiohttp.ClientSession, cid: int) -> None:
            i = offset + cid * 7919
            while time.perf_counter() < stop:
                items = [{"text": texts[(i + k) % len(texts)]} for k in range(per_request)]
                i += per_request
                body = json.dumps({"items": items}).encode() if use_json else packb({"items": items})
                t = time.perf_counter()
                async with session.post(f"{url}/v1/encode/{model}", data=body, headers=headers) as r:
                    data = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
                lat.append(time.perf_counter() - t)

        conn = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(one(s, c) for c in range(clients)))
        return lat

    return asyncio.run(run())


class Load:
    def __init__(self, procs: int) -> None:
        self.pool = mp.get_context("spawn").Pool(procs)
        self.procs = procs

    def run(self, url: str, w: Workload, seconds: float) -> tuple[float, float, float]:
        """(texts/s, p50 ms, p99 ms) of ``w`` against ``url`` for ``seconds``."""
        procs = min(self.procs, w.clients)
        per = [w.clients // procs + (1 if i < w.clients % procs else 0) for i in range(procs)]
        start = time.perf_counter()
        jobs = [
            self.pool.apply_async(
                _client_proc,
                (url, f"bench/{w.model}", w.texts, w.per_request, n, seconds, w.json, i * 104729),
            )
            for i, n in enumerate(per)
        ]
        lat = sorted(x for j in jobs for x in j.get(seconds + 180))
        elapsed = time.perf_counter() - start
        return len(lat) * w.per_request / elapsed, lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3

    def pids(self) -> list[int]:
        return [p.pid for p in self.pool._pool]  # type: ignore[attr-defined]

    def close(self) -> None:
        self.pool.terminate()


class GpuBusy:
    """Mean GPU utilisation (NVML, sampled every 100 ms) while the block runs."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.handle = None
        if DEVICE != "cuda":
            return
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(
            int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
        )

    def __enter__(self) -> GpuBusy:
        self.samples, self._stop = [], threading.Event()

        def sample() -> None:
            while self.handle is not None and not self._stop.wait(0.1):
                self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")


def cpu_seconds(pid: int) -> float:
    """:func:`tests.benchmarks.run.cpu_seconds`, 0 once the process is gone (a restarted child)."""
    from tests.benchmarks.run import cpu_seconds as of_live

    try:
        return of_live(pid)
    except OSError:
        return 0.0


class CpuMeter:
    """Cores used by each named group of processes while the block runs (``{group: [pid, ...]}``)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.cores: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self._start = time.perf_counter()
        self._before = {g: sum(map(cpu_seconds, pids)) for g, pids in self.groups.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._start
        self.cores = {
            g: (sum(map(cpu_seconds, pids)) - self._before[g]) / wall for g, pids in self.groups.items()
        }

    def line(self) -> str:
        return "CPU cores: " + ", ".join(f"{g} {c:.2f}" for g, c in self.cores.items())


class PodForwards:
    """The cluster pods' forwards of one model over a block: summed forward time per item, and the
    mean share of the time each pod's worker ran a forward (``sie_worker_forward_seconds_total``)."""

    def __init__(self, metrics_urls: list[str], model: str) -> None:
        self.urls, self.model = metrics_urls, model
        self.ms_per_item = self.busy = float("nan")

    def _totals(self) -> tuple[float, float]:
        from tests.benchmarks.run import ForwardMeter

        totals = [ForwardMeter(url, self.model).totals() for url in self.urls]
        return sum(f for f, _ in totals), sum(n for _, n in totals)

    def __enter__(self) -> PodForwards:
        self._f0, self._n0 = self._totals()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._start
        f1, n1 = self._totals()
        fwd, items = f1 - self._f0, n1 - self._n0
        self.ms_per_item = fwd / items * 1e3 if items else float("nan")
        self.busy = fwd / wall / len(self.urls) if self.urls else float("nan")

    def line(self) -> str:
        """``; pods' forwards: …``, or nothing without pods (``sie serve``)."""
        return f"; pods' forwards: {self.ms_per_item:.3f} ms/item, busy {self.busy:.2f}" if self.urls else ""


# ---- in-process measurements -------------------------------------------------------------------
def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def matmul_tflops() -> float:
    """bf16 n³ matmul rate on random data (8192 on CUDA; 1024 on the CPU of a smoke run)."""
    import torch

    n = 8192 if DEVICE == "cuda" else 1024
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    reps = 20 if DEVICE == "cuda" else 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def inprocess(root: Path, w: Workload, seconds: float) -> dict[str, float]:
    """seq/s of transformers (padded batches of the request size, sorted lengths) and of our packed
    forward on the same tokenised inputs, bf16."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from worker.modeling.packed import PackedEncoder, pool_packed

    path = str(root / w.model)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(w.texts, truncation=True, max_length=512)["input_ids"]
    model = (
        AutoModel.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEVICE).eval()
    )
    batch = max(w.per_request, 64 if w.per_request > 1 else 1)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = [[ids[i] for i in order[s : s + batch]] for s in range(0, len(order), batch)]
    random.Random(0).shuffle(batches)

    def padded(seqs):
        width = max(map(len, seqs))
        x = torch.zeros((len(seqs), width), dtype=torch.long)
        m = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            x[r, : len(s)] = torch.tensor(s)
            m[r, : len(s)] = 1
        return x.to(DEVICE), m.to(DEVICE)

    def hf(seqs):
        x, m = padded(seqs)
        return model(input_ids=x, attention_mask=m).last_hidden_state[:, 0]

    enc = PackedEncoder(model)

    def packed(seqs):
        b = enc.pack(seqs, DEVICE)
        return pool_packed(enc(b), b, "mean")

    out = {}
    with torch.inference_mode():
        for name, fn in (("transformers", hf), ("packed", packed)):
            for seqs in batches[:3]:
                fn(seqs)
            sync()
            done, start, i = 0, time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                fn(batches[i % len(batches)])
                done += len(batches[i % len(batches)])
                i += 1
            sync()
            out[name] = done / (time.perf_counter() - start)
    return out


def served_min_cosine(url: str, root: Path, model: str) -> float:
    """Served bf16 vectors of mixed-length texts against fp32 transformers on the same texts."""
    import httpx
    import torch
    from transformers import AutoModel, AutoTokenizer

    lengths = [8, 17, 64, 128, 255, 300, 511, 512] * 4
    texts = texts_of(lengths, seed=99)
    r = httpx.post(
        f"{url}/v1/encode/bench/{model}",
        content=packb({"items": [{"text": t} for t in texts]}),
        headers={"Content-Type": "application/msgpack"},
        timeout=120,
    )
    r.raise_for_status()
    got = np.stack(
        [np.asarray(item["dense"]["values"], dtype=np.float32) for item in unpackb(r.content)["items"]]
    )
    path = str(root / model)
    tok = AutoTokenizer.from_pretrained(path)
    ref_model = AutoModel.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        enc = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt").to(DEVICE)
        hidden = ref_model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).cpu().numpy()
    del ref_model
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    return float(cos.min())


# ---- the run -----------------------------------------------------------------------------------
@dataclass
class Row:
    target: str
    w: Workload
    rates: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)


@dataclass
class Target:
    """Something to send the load to: its name in the table, URL, the processes whose CPU its lines
    report, and (a cluster) its pods' metrics URLs."""

    name: str
    url: str
    groups: dict[str, list[int]]
    pod_metrics: list[str] = field(default_factory=list)
    json: bool = True  # also the JSON workloads (sie serve; the cluster rows compare msgpack)
    logs: Callable[[], str] = lambda: ""  # the tails of its logs, printed when measuring fails

    def runs(self, w: Workload) -> bool:
        return self.json or not w.json


def measure(
    targets: list[Target],
    ws: list[Workload],
    load: Load,
    rounds: int,
    seconds: float,
    rows: dict[tuple[str, str], Row],
    peak: float,
) -> None:
    """``rounds`` of every workload against every target: each workload runs on each target in turn,
    in an order that flips every round, so that they share the host's moments alike. Each
    measurement's line, then where the CPU went and, for a cluster, its pods' forwards."""
    for t in targets:
        for w in ws:  # warm-up: model load and first shapes
            if t.runs(w):
                load.run(t.url, w, 2.0)
    for rnd in range(rounds):
        for w in ws:
            for t in targets if rnd % 2 == 0 else targets[::-1]:
                if not t.runs(w):
                    continue
                groups = {"clients": load.pids(), **t.groups}
                with (
                    GpuBusy() as busy,
                    CpuMeter(groups) as cpu,
                    PodForwards(t.pod_metrics, f"bench/{w.model}") as pods,
                ):
                    rate, p50, p99 = load.run(t.url, w, seconds)
                row = rows.setdefault((t.name, w.name), Row(t.name, w))
                row.rates.append(rate), row.p50.append(p50), row.p99.append(p99), row.busy.append(busy.mean)
                mfu = rate * w.flops() / (peak * 1e12)
                print(
                    f"round {rnd + 1} {t.name:16} {w.name:40} {rate:9.1f}/s  MFU {mfu:6.1%}  p50 {p50:8.1f} ms  "
                    f"p99 {p99:8.1f} ms  GPU busy {busy.mean:5.1f}%",
                    flush=True,
                )
                print(f"        {cpu.line()}{pods.line()}", flush=True)


#: a forward pass of up to 64 × 512 tokens: bigger matmuls than the 16,384-token default keep an H100 busier
ENV = {"SIE_DEVICE": "cuda", "SIE_TORCH_THREADS": "0", "SIE_HF_OFFLINE": "1", "SIE_MAX_BATCH_COST": "32768"}


def start_clusters(
    args: argparse.Namespace, root: Path, models_dir: Path, stack: contextlib.ExitStack
) -> list[Target]:
    """The clusters to measure: one per (pod shape, gateway count, variables variant), all up at once
    (stopped by ``stack``) and measured in turn with ``sie serve`` (``measure``)."""
    from deploy.launcher import default_gateways, default_model_processes, default_workers
    from tests.benchmarks.cluster_ab import VariantCluster, parse_env
    from tests.support.cluster import free_cluster_ports

    os.environ.update(ENV)
    shapes = str(args.cluster_pods or f"{default_workers(ENV)}x{default_model_processes(ENV)}")
    variants = [parse_env(v) for v in str(args.cluster_env).split("|")]
    targets: list[Target] = []
    counts = str(args.cluster_gateways or default_gateways(ENV))
    for shape in shapes.split(","):
        pods, processes = (int(n) for n in shape.split("x"))
        for gateways in (int(g) for g in counts.split(",")):
            for i, extra in enumerate(variants):
                name = (
                    f"cluster {pods}x{processes}"
                    + (f" g{gateways}" if gateways > 1 else "")
                    + (f" v{i + 1}" if len(variants) > 1 else "")
                )
                print(
                    f"{name}: {pods} worker pod(s) of {processes} model process(es), {gateways} "
                    f"gateway(s), {extra or 'default settings'}",
                    flush=True,
                )
                cluster = VariantCluster(
                    state_dir=Path(tempfile.mkdtemp(prefix="state-", dir=root)),
                    **free_cluster_ports(),
                    models_dir=str(models_dir),
                    preload="bench/bge-base,bench/minilm",
                    workers=pods,
                    model_processes=processes,
                    gateways=gateways,
                    metrics_port=free_ports(pods * processes),
                    extra=extra,
                )
                stack.callback(cluster.stop)
                try:
                    cluster.start(say=lambda line: print("cluster:", line, flush=True))
                except Exception as exc:  # the other rows still run: one failure should not cost the lease
                    print(f"{name} failed to start: {exc!r}\n{cluster_logs(cluster)}", flush=True)
                    continue
                groups: dict[str, list[int]] = {}
                for child_name, child in cluster.supervisor.children.items():
                    if child.proc is not None and child_name != "config":
                        # a pod's sibling processes are children of its process 0
                        groups.setdefault(child_name.split("-")[0], []).extend(descendants(child.proc.pid))
                metrics = [f"http://127.0.0.1:{p}/metrics" for pod in cluster.pods for p in pod.metrics_ports]
                logs = functools.partial(cluster_logs, cluster)
                targets.append(Target(name, cluster.gateway_url, groups, metrics, json=False, logs=logs))
    return targets


def cluster_logs(cluster) -> str:
    """The tails of a cluster's worker, sidecar and gateway logs."""
    out = []
    for name in [n for pod in cluster.pods for n in (pod.worker, pod.sidecar)] + cluster.gateway_names:
        log = cluster.state_dir / "logs" / f"{name}.log"
        if log.exists():
            out.append(f"--- {name}.log (tail)\n" + log.read_text(errors="replace")[-3000:])
    return "\n".join(out)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (the launcher gives pod i the port first + i)."""
    from tests.support.nats_server import free_port

    while True:
        first = free_port()
        try:
            for port in range(first, first + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def start_serve(models_dir: Path, processes: int) -> ServeProcess:
    import httpx

    server = ServeProcess(
        env={
            **ENV,
            "SIE_MODELS_DIR": str(models_dir),
            "SIE_MODEL_PROCESSES": str(processes),
            "SIE_PRELOAD_MODELS": "bench/bge-base,bench/minilm",
        }
    )
    server.start(timeout=300)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # every sibling preloads on its own: wait until all answer ready
        if all(httpx.get(server.url + "/readyz").status_code == 200 for _ in range(8 * processes)):
            break
        time.sleep(0.5)
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="measuring time per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--client-procs", type=int, default=6, help="client processes generating load")
    ap.add_argument(
        "--serve-processes",
        default="4",
        help="SIE_MODEL_PROCESSES of sie serve; a comma-separated list measures each",
    )
    ap.add_argument(
        "--only",
        default="",
        help="workloads to run, |-separated: a whole name picks that one, any other text every "
        "name holding it",
    )
    ap.add_argument("--no-cluster", action="store_true", help="skip the cluster-path rows")
    ap.add_argument(
        "--cluster-pods",
        default="",
        help="the cluster's worker pods as PODSxPROCESSES (sie up --workers, --model-processes), "
        "comma-separated to measure each, e.g. '1x4,4x1'; default: as sie up deploys them on this "
        "host, as the chart does (one pod per GPU, 4 model processes in it)",
    )
    ap.add_argument(
        "--cluster-gateways",
        default="",
        help="gateways of the cluster (sie up --gateways; default: sie up's on this host); a "
        "comma-separated list measures each",
    )
    ap.add_argument(
        "--cluster-env",
        default="",
        help="'|'-separated variants of extra variables for every cluster process, each K=V[,K=V...] "
        "('' = default settings), e.g. '|SIE_BATCHER_MAX_BATCH_WAIT_MS=5': each variant is a cluster "
        "of its own, measured in turn with the others",
    )
    ap.add_argument("--no-inprocess", action="store_true", help="skip the in-process baselines")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check the script end to end on the CPU: tiny models, one short round, few clients",
    )
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("GPU benchmark skipped: torch is not installed")
        return 0
    global DEVICE
    if args.smoke:
        DEVICE = ENV["SIE_DEVICE"] = "cpu"
        SHAPES.update({"bge-base": (2, 64, 4, 128), "minilm": (1, 32, 4, 64)})
        args.seconds, args.rounds, args.client_procs = min(args.seconds, 1.0), 1, min(args.client_procs, 2)
        args.serve_processes = "1"
    elif not torch.cuda.is_available():
        print("GPU benchmark skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run: tiny models)"
    load = Load(args.client_procs)
    every = workloads()
    names = {w.name for w in every}
    # an entry that is a whole workload's name picks that one only ("512 tok, 32/req x 16 clients" is
    # also part of the JSON and MiniLM names); any other entry picks every name it is part of
    wanted = [s for s in args.only.split("|") if s]
    ws = [
        w for w in every if not wanted or any(s == w.name or (s not in names and s in w.name) for s in wanted)
    ]
    if args.smoke:
        for w in ws:
            w.clients = min(w.clients, 4)
    peak = matmul_tflops()
    print(f"device: {device_name}; bf16 matmul: {peak:.1f} TFLOP/s (the MFU ceiling)", flush=True)
    rows: dict[tuple[str, str], Row] = {}
    base: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sie-gpu-bench-") as tmp:
        root = Path(tmp)
        models_dir = build_models(root)
        if not args.no_inprocess:
            for w in ws:
                if not w.json:
                    base[w.name] = inprocess(root, w, args.seconds)
                    print(
                        f"in-process {w.name:40} transformers {base[w.name]['transformers']:9.1f}/s  "
                        f"packed {base[w.name]['packed']:9.1f}/s",
                        flush=True,
                    )
        cosines = {}
        targets: list[Target] = []
        with contextlib.ExitStack() as stack:
            for procs in (int(p) for p in str(args.serve_processes).split(",")):
                server = None
                try:
                    server = start_serve(models_dir, procs)
                    stack.callback(server.stop)
                    cosines = cosines or {m: served_min_cosine(server.url, root, m) for m in SHAPES}
                    assert server.proc is not None
                    targets.append(
                        Target(
                            f"serve x{procs}",
                            server.url,
                            {"sie serve": descendants(server.proc.pid)},
                            logs=server.output,
                        )
                    )
                except Exception as exc:  # the other rows still run: one failure should not cost the lease
                    print(f"sie serve x{procs} failed: {exc!r}", flush=True)
                    if server is not None:
                        print("--- sie serve log (tail)\n" + server.output(), flush=True)
            if not args.no_cluster:
                targets += start_clusters(args, root, models_dir, stack)
            try:
                measure(targets, ws, load, args.rounds, args.seconds, rows, peak)
            except Exception as exc:
                print(f"measuring failed: {exc!r}", flush=True)
                for t in targets:
                    print(f"=== {t.name}\n{t.logs()}", flush=True)
    load.close()
    print()
    print(
        f"GPU benchmark: {device_name}, bf16, ceiling {peak:.0f} TFLOP/s (matmul measured in "
        f"this run); {args.rounds} rounds x {args.seconds:.0f} s, medians; texts/s; 'serve xN' = sie serve with "
        f"SIE_MODEL_PROCESSES=N; 'cluster PxN' = sie up --workers P --model-processes N (gK: --gateways K; "
        f"vK: --cluster-env's Kth variant); 'vs serve' = cluster / the best serve row"
    )
    head = (
        f"{'target':16} {'workload':40} {'texts/s':>9} {'MFU':>6} {'p50 ms':>8} {'p99 ms':>8} {'GPU %':>6} "
        f"{'HF in-proc':>10} {'packed in-proc':>14} {'vs serve':>8}"
    )
    print(head)
    print("-" * len(head))
    for (target, name), r in rows.items():
        rate = statistics.median(r.rates)
        mfu = rate * r.w.flops() / (peak * 1e12)
        b = base.get(name, {})
        serve = max(
            (r2 for (t2, n2), r2 in rows.items() if n2 == name and t2.startswith("serve")),
            key=lambda r2: statistics.median(r2.rates),
            default=None,
        )
        ratio = (
            f"{rate / statistics.median(serve.rates):7.2f}x"
            if target.startswith("cluster") and serve
            else "       -"
        )
        hf = f"{b['transformers']:10.1f}" if b else f"{'-':>10}"
        pk = f"{b['packed']:14.1f}" if b else f"{'-':>14}"
        print(
            f"{target:16} {name:40} {rate:9.1f} {mfu:6.1%} {statistics.median(r.p50):8.1f} "
            f"{statistics.median(r.p99):8.1f} {statistics.median(r.busy):6.1f} {hf} {pk} {ratio}"
        )
    print()
    for m, c in cosines.items():
        print(f"correctness: bench/{m} served bf16 vs fp32 transformers, min cosine {c:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
