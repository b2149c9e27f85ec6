"""Benchmark rows of issue 17 on the cluster path (``sie up``'s launcher): the result cache's hit
path and the priority classes.

* cache hit path: the same requests answered from the gateway's result cache (nothing published)
  beside the same requests with ``X-SIE-Cache: off`` through the whole path (``sie-fake``, so the
  path is what is measured, not a model).
* priority: MiniLM; interactive single-text p99 with the cluster idle, then with a bulk backlog of
  ``bulk_items`` items queued (``X-SIE-Priority: bulk``); the bulk rate alone and under the
  interactive probe. Every text is unique and the cache is off, so every item is computed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from protocol.codec import packb

D = "sentence-transformers/all-MiniLM-L6-v2"
HEADERS = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
OFF = {"X-SIE-Cache": "off"}
BATCH_LINE_TEXTS = 25  # texts per line of the Batch API row's batches (bench_batch, batch_ab)


async def _post(
    session: aiohttp.ClientSession, url: str, model: str, texts: list[str], headers: dict
) -> None:
    body = packb({"items": [{"text": t} for t in texts]})
    async with session.post(f"{url}/v1/encode/{model}", data=body, headers={**HEADERS, **headers}) as r:
        data = await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")


def _pct(lat: list[float], q: float) -> float:
    lat = sorted(lat)
    return lat[min(len(lat) - 1, int(len(lat) * q))] * 1000 if lat else float("nan")


async def _load(
    url: str, model: str, per_req: int, clients: int, seconds: float, headers: dict, unique: bool
) -> tuple[float, float, float]:
    """(items/s, p50 ms, p99 ms) of ``clients`` closed-loop clients."""
    lat: list[float] = []
    done = 0
    stop = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, cid: int) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < stop:
            n += 1
            tag = f"{cid}-{n}" if unique else str(cid)
            texts = [f"text {tag} {k} of the cache benchmark" for k in range(per_req)]
            t = time.perf_counter()
            await _post(session, url, model, texts, headers)
            lat.append(time.perf_counter() - t)
            done += per_req

    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, c) for c in range(clients)))
    return done / (time.perf_counter() - start), _pct(lat, 0.5), _pct(lat, 0.99)


def bench_cache_hits(url: str, seconds: float) -> list[str]:
    lines = [
        f"result cache hit path (gateway only) vs the full path with X-SIE-Cache: off, sie-fake, {seconds:.0f} s",
        f"{'workload':26} {'hit items/s':>11} {'hit p50/p99 ms':>15} {'off items/s':>11} {'off p50/p99 ms':>15}",
    ]
    for per_req, clients in ((1, 1), (1, 16), (32, 4)):
        asyncio.run(_load(url, "sie-fake", per_req, clients, 1.0, {}, unique=False))  # fill the cache
        h_rate, h50, h99 = asyncio.run(_load(url, "sie-fake", per_req, clients, seconds, {}, unique=False))
        o_rate, o50, o99 = asyncio.run(_load(url, "sie-fake", per_req, clients, seconds, OFF, unique=False))
        lines.append(
            f"{f'{per_req}/req x {clients} clients':26} {h_rate:11.1f} {h50:7.2f}/{h99:7.2f} "
            f"{o_rate:11.1f} {o50:7.2f}/{o99:7.2f}"
        )
    return lines


async def _bulk(url: str, n_items: int, per_req: int, tag: str) -> float:
    """Queue ``n_items`` bulk items at once (n_items/per_req concurrent requests); seconds until all are done."""
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(
            _post(session, url, D, [f"bulk {tag} {i} {k} document text for the re-index" for k in range(per_req)],
                  {**OFF, "X-SIE-Priority": "bulk"})
            for i in range(n_items // per_req)
        ))  # fmt: skip
    return time.perf_counter() - start


async def _probe(url: str, until: asyncio.Future | None, seconds: float) -> list[float]:
    """Sequential interactive single-text requests until ``until`` is done (or for ``seconds``)."""
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    n = 0
    async with aiohttp.ClientSession() as session:
        while (until is not None and not until.done()) or (until is None and time.perf_counter() < stop):
            n += 1
            t = time.perf_counter()
            await _post(session, url, D, [f"interactive query {n} {time.time()}"], OFF)
            lat.append(time.perf_counter() - t)
    return lat


async def _mixed(url: str, n_items: int, per_req: int) -> tuple[float, list[float]]:
    bulk = asyncio.ensure_future(_bulk(url, n_items, per_req, "mixed"))
    await asyncio.sleep(1.0)  # let the backlog build before probing
    lat = await _probe(url, bulk, 0)
    return await bulk, lat


def bench_priority(url: str, seconds: float, bulk_items: int) -> list[str]:
    per_req = 250
    bulk_items = max(per_req, bulk_items // per_req * per_req)
    asyncio.run(_probe(url, None, 2.0))  # warm-up
    idle = asyncio.run(_probe(url, None, seconds))
    solo_s = asyncio.run(_bulk(url, bulk_items, per_req, "solo"))
    mixed_s, busy = asyncio.run(_mixed(url, bulk_items, per_req))
    idle99, busy99 = _pct(idle, 0.99), _pct(busy, 0.99)
    solo_rate, mixed_rate = bulk_items / solo_s, bulk_items / mixed_s
    return [
        f"priority classes, MiniLM, bulk backlog of {bulk_items} items ({per_req}/req, all queued at once)",
        f"interactive 1 text, idle:         p50 {_pct(idle, 0.5):7.1f} ms  p99 {idle99:7.1f} ms  ({len(idle)} requests)",
        f"interactive 1 text, bulk backlog: p50 {_pct(busy, 0.5):7.1f} ms  p99 {busy99:7.1f} ms  ({len(busy)} requests)"
        f"  = {busy99 / idle99:.2f}x idle p99",
        f"bulk alone {solo_rate:8.1f} items/s; with the interactive probe {mixed_rate:8.1f} items/s"
        f"  = {mixed_rate / solo_rate:.0%} of solo",
    ]


async def _batch(url: str, lines: int, per_line: int) -> float:
    """Run a Batch API batch of ``lines`` lines (``per_line`` texts each) to its end; its seconds.
    Its texts are new in every run, so that no round is answered from the result cache."""
    import json

    tag = time.time_ns()

    content = b"".join(
        json.dumps({
            "custom_id": f"b{i}", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": D, "input": [f"batch {tag} {i} {k} corpus text of the batch row" for k in range(per_line)]},
        }).encode() + b"\n"
        for i in range(lines)
    )  # fmt: skip
    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="corpus.jsonl")
        async with session.post(f"{url}/v1/files", data=form) as r:
            file_id = (await r.json())["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        async with session.post(f"{url}/v1/batches", json=body) as r:
            batch_id = (await r.json())["id"]
        while True:
            await asyncio.sleep(0.5)
            async with session.get(f"{url}/v1/batches/{batch_id}") as r:
                batch = await r.json()
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                if batch["status"] != "completed" or batch["request_counts"]["failed"]:
                    raise RuntimeError(f"batch ended {batch['status']}: {batch['request_counts']}")
                return time.perf_counter() - start


async def _batch_probed(url: str, lines: int, per_line: int) -> tuple[float, list[float]]:
    batch = asyncio.ensure_future(_batch(url, lines, per_line))
    await asyncio.sleep(1.0)  # the batch's first lines in the queue before probing
    lat = await _probe(url, batch, 0)
    return await batch, lat


def bench_batch(url: str, seconds: float, lines: int, rounds: int = 3) -> list[str]:
    """Interactive single-text p99 idle and while a Batch API batch runs (issue 34's row), the two
    interleaved: the idle cluster is probed before the first batch and after each one, and each
    round's batch is held against the idle probes on either side of it, pooled, so that a host
    that speeds up or slows down over a round weighs on both sides alike (until 2026-11-28 only the
    probe before it: the rounds over 1.5x were those whose idle probe came out fastest). Each idle
    probe runs at least 30 s: both p99s then stand on thousands of requests (a batch of 200 lines
    takes 40-50 s alone), where 6 s of idle probing gave about 450 and a p99 that was their fifth
    slowest (14.6-20.8 ms from round to round of one run, the busy p99 21.8-24.0)."""
    per_line = BATCH_LINE_TEXTS
    idle_seconds = max(seconds, 30.0)
    asyncio.run(_probe(url, None, 2.0))  # warm-up
    out = [
        f"Batch API, MiniLM: a batch of {lines} lines x {per_line} texts beside interactive single-text requests"
    ]
    ratios = []
    before = asyncio.run(_probe(url, None, idle_seconds))
    for r in range(1, rounds + 1):
        batch_s, busy = asyncio.run(_batch_probed(url, lines, per_line))
        after = asyncio.run(_probe(url, None, idle_seconds))
        idle = before + after
        idle99, busy99 = _pct(idle, 0.99), _pct(busy, 0.99)
        ratios.append(busy99 / idle99)
        out += [
            f"round {r}: interactive 1 text, idle:          p50 {_pct(idle, 0.5):7.1f} ms  p99 {idle99:7.1f} ms"
            f"  ({len(idle)} requests; p99 {_pct(before, 0.99):.1f} before the batch, {_pct(after, 0.99):.1f} after)",
            f"round {r}: interactive 1 text, batch running: p50 {_pct(busy, 0.5):7.1f} ms  p99 {busy99:7.1f} ms"
            f"  ({len(busy)} requests)  = {busy99 / idle99:.2f}x idle p99 (goal <= 1.5x)",
            f"round {r}: batch {lines * per_line / batch_s:8.1f} texts/s while probed ({batch_s:.1f} s)",
        ]
        before = after
    out.append(f"busy/idle p99 per round: {', '.join(f'{x:.2f}x' for x in ratios)}; worst {max(ratios):.2f}x")
    return out


def bench_classes(
    seconds: float,
    threads: int,
    bulk_items: int,
    batch_lines: int = 0,
    only_batch: bool = False,
    worker_cpus: int = 0,
) -> list[str]:
    from deploy.launcher import Cluster
    from tests.support.cluster import free_cluster_ports

    if worker_cpus:  # the workers' torch threads as many as their CPUs, as the launcher sets them
        threads = worker_cpus
    os.environ.update({
        "SIE_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "SIE_HF_OFFLINE": "1",
        "SIE_GATEWAY_REQUEST_TIMEOUT_S": "3600", "SIE_GATEWAY_MAX_STREAM_PENDING": str(max(50_000, 2 * bulk_items)),
        "SIE_STREAM_MAX_MSGS": str(max(100_000, 3 * bulk_items)), "SIE_GATEWAY_MAX_ITEMS": "4096",
        "SIE_RESULT_CACHE_ENABLED": "true",  # the cache rows measure it; the priority rows send X-SIE-Cache: off
    })  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sie-bench-classes-") as tmp:
        cluster = Cluster(
            state_dir=Path(tmp),
            **free_cluster_ports(),
            preload=f"{D},sie-fake",
            worker_cpus=worker_cpus,
        )
        try:
            cluster.start(say=lambda line: None)
            split = cluster.cpu_split()
            if split is not None:  # the clients beside the cluster's other processes, off the workers' CPUs
                os.sched_setaffinity(0, split[1])
            lines: list[str] = (
                [
                    f"the workers on CPUs {sorted(split[0])} of their own, every other process and the clients "
                    f"on {sorted(split[1])}"
                ]
                if split is not None
                else []
            )
            if not only_batch:
                lines += bench_cache_hits(cluster.gateway_url, seconds)
                lines.append("")
                lines += bench_priority(cluster.gateway_url, seconds, bulk_items)
            if batch_lines:
                lines += ["", *bench_batch(cluster.gateway_url, seconds, batch_lines)]
        finally:
            cluster.stop()
    return lines
