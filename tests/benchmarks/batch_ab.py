"""The Batch API row as an A/B of two worker settings, on two clusters side by side.

``python -m tests.benchmarks.batch_ab --a SIE_PREEMPT_SPARE_CORE_MS=0 --b SIE_PREEMPT_SPARE_CORE_MS=1000``:
both clusters start (MiniLM), then pairs of rounds alternate between them (A B, B A, ...). A round
probes its cluster idle (20 s), runs a batch beside the single-text probe, and probes it idle
again; each round prints the busy p50/p95/p99 beside the pooled idle ones. The idle cluster of the
pair costs the other only its heartbeats, and both meet the host's spells alike, so the busy
figures of one pair compare where one run's ratios against its own idle probe swing with them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from tests.benchmarks.classes import BATCH_LINE_TEXTS as PER_LINE
from tests.benchmarks.classes import D, _batch_probed, _pct, _probe


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", action="append", default=[], help="KEY=VALUE for cluster A (repeatable)")
    ap.add_argument("--b", action="append", default=[], help="KEY=VALUE for cluster B (repeatable)")
    ap.add_argument("--lines", type=int, default=80, help="batch lines (25 texts each) per round")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=20.0, help="each idle probe's length")
    args = ap.parse_args(argv)

    from tests.benchmarks.cluster_ab import VariantCluster
    from tests.support.cluster import free_cluster_ports

    os.environ.update({
        "SIE_TORCH_THREADS": str(os.cpu_count() or 1), "SIE_HF_OFFLINE": "1",
        "SIE_GATEWAY_REQUEST_TIMEOUT_S": "3600", "SIE_GATEWAY_MAX_ITEMS": "4096",
    })  # fmt: skip
    clusters: dict[str, VariantCluster] = {}
    with tempfile.TemporaryDirectory(prefix="sie-batch-ab-") as tmp:
        try:
            for name, pairs in (("A", args.a), ("B", args.b)):
                clusters[name] = VariantCluster(
                    state_dir=Path(tmp) / name, **free_cluster_ports(), preload=D,
                    extra=dict(p.split("=", 1) for p in pairs),
                )  # fmt: skip
                clusters[name].start(say=lambda line: None)
                print(f"{name}: {' '.join(pairs) or '(defaults)'}", flush=True)
            for cluster in clusters.values():
                asyncio.run(_probe(cluster.gateway_url, None, 3.0))  # warm-up
            busy99: dict[str, list[float]] = {name: [] for name in clusters}
            for p in range(1, args.pairs + 1):
                for name in list(clusters) if p % 2 else list(reversed(clusters)):
                    url = clusters[name].gateway_url
                    before = asyncio.run(_probe(url, None, args.idle_s))
                    batch_s, busy = asyncio.run(_batch_probed(url, args.lines, PER_LINE))
                    after = asyncio.run(_probe(url, None, args.idle_s))
                    idle = before + after
                    busy99[name].append(_pct(busy, 0.99))
                    print(
                        f"pair {p} {name}: idle p50 {_pct(idle, 0.5):.1f} p99 {_pct(idle, 0.99):.1f} ms ({len(idle)});"
                        f" batch running p50 {_pct(busy, 0.5):.1f} p95 {_pct(busy, 0.95):.1f}"
                        f" p99 {_pct(busy, 0.99):.1f} ms ({len(busy)}) = {_pct(busy, 0.99) / _pct(idle, 0.99):.2f}x idle p99;"
                        f" batch {args.lines * PER_LINE / batch_s:.1f} texts/s",
                        flush=True,
                    )
            pairs_b_over_a = [b / a for a, b in zip(busy99["A"], busy99["B"], strict=True)]
            print("busy p99 B/A per pair: " + ", ".join(f"{x:.2f}" for x in pairs_b_over_a), flush=True)
        finally:
            for cluster in clusters.values():
                cluster.stop()


if __name__ == "__main__":
    main()
