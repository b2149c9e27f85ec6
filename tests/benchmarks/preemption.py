"""Interactive batches inside bulk forwards, in one worker process: an A/B of ``SIE_PREEMPT_MAX_SHARE``.

``python -m tests.benchmarks.preemption`` loads MiniLM once per share (``SHARES``, default
``0,0.5,1``; 0 = no preemption) and, round by round in alternating order, measures for each: bulk
alone (RunBatch of 8 texts, one after another), then bulk beside a closed-loop interactive probe
(RunBatch of one text, one after another): the bulk rate and its share of the solo rate, and the
probe's p50/p99; at the end the probe alone. No gateway, sidecar or NATS share the cores, so the
numbers show what the forward thread does (worker/batching/preemption.py). ``SECS`` and
``ROUNDS`` set the length.
"""

import asyncio
import os
import time

from protocol.work_codec import WorkCodec
from tests.benchmarks.run import sentences
from tests.support.jobs import encode_job, encode_messages
from worker.ipc.server import IpcHandler
from worker.runtime import Runtime
from worker.settings import WorkerSettings

M = "sentence-transformers/all-MiniLM-L6-v2"
texts = sentences(512, 32, seed=1)
SHARES = [float(x) for x in os.environ.get("SHARES", "0,0.5,1").split(",")]
SECS = float(os.environ.get("SECS", "8"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def body(n, start, priority):
    job = encode_job(f"r{start}", n, model_id=M)
    msgs = encode_messages(job, [texts[(start + i) % len(texts)] for i in range(n)], per_message=n)
    routes, (shared, owns) = WorkCodec.routes(msgs[0].headers), WorkCodec.split(msgs[0].payload, n)
    parts = [(r.work_item_id, shared, own) for r, own in zip(routes, owns, strict=True)]
    return WorkCodec.run_batch(M, parts, worker_id="w", priority=priority).to_map()


async def measure(h, seconds, with_bulk=True):
    stop = time.perf_counter() + seconds
    bulk_items = 0
    lat = []

    async def bulk():
        nonlocal bulk_items
        k = 0
        while time.perf_counter() < stop:
            await h.run_batch(body(8, k, "bulk"))
            bulk_items += 8
            k += 8

    async def probe():
        k = 0
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await h.run_batch(body(1, 10000 + k, "interactive"))
            lat.append(time.perf_counter() - t)
            k += 1

    tasks = [probe()] + ([bulk()] if with_bulk else [])
    await asyncio.gather(*tasks)
    lat.sort()
    return bulk_items / seconds, lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000, len(lat)


async def main():
    hs = {}
    for share in SHARES:
        rt = Runtime(WorkerSettings(device="cpu", preempt_max_share=share))
        while (await rt.ensure_ready(M)).state != "ready":
            await asyncio.sleep(0.1)
        hs[share] = IpcHandler(rt)
    for h in hs.values():
        await measure(h, 1.0)
    for r in range(ROUNDS):
        for share in SHARES if r % 2 == 0 else SHARES[::-1]:
            h = hs[share]
            t_end = time.perf_counter() + SECS / 2
            n = 0
            k = 0
            while time.perf_counter() < t_end:
                await h.run_batch(body(8, k, "bulk"))
                n += 8
                k += 8
            solo_rate = n / (SECS / 2)
            b, p50, p99, cnt = await measure(h, SECS)
            print(
                f"round {r + 1} share {share:3.1f}: bulk alone {solo_rate:6.1f}/s, with probe {b:6.1f}/s ({b / solo_rate:4.0%}); interactive p50 {p50:6.1f} p99 {p99:6.1f} ms ({cnt})",
                flush=True,
            )
    _, i50, i99, _ = await measure(hs[SHARES[0]], SECS, with_bulk=False)
    print(f"interactive alone: p50 {i50:.1f} p99 {i99:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
