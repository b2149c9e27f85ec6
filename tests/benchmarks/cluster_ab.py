"""A/B of cluster settings: two clusters (``sie up``'s launcher), one per variant, beside ``sie serve``.

``python -m tests.benchmarks.cluster_ab --a "" --b "GOMP_SPINCOUNT=300000"`` starts ``sie serve`` and
two clusters whose children get the variant's variables on top of the usual ones, then drives the
same MiniLM workload (``--per`` sentences per request × ``--clients``) through all three, round by
round, A and B in alternating order. It prints every round (rate, p50/p99, each cluster's ratio to
``sie serve`` in that round) and the mean and lowest ratio per variant. Running both variants in
one run, interleaved, is what makes a few-percent difference visible on a noisy host: between two
separate runs the ratio moves more than that. An A/A run (``--a "" --b ""``) shows the harness's
own spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from deploy.launcher import Cluster
from tests.benchmarks.load import run_load
from tests.benchmarks.run import OFF, D, sentences
from tests.support.cluster import free_cluster_ports
from tests.support.serve import ServeProcess


def parse_env(text: str) -> dict[str, str]:
    """``"K=V,K2=V2"`` → a dict; ``""`` → no variables."""
    pairs = [kv for kv in text.split(",") if kv.strip()]
    if any("=" not in kv for kv in pairs):
        raise SystemExit(f"a variant is K=V[,K=V...], got {text!r}")
    return dict(kv.strip().split("=", 1) for kv in pairs)


@dataclass
class VariantCluster(Cluster):
    """The launcher's cluster with extra variables for every child."""

    extra: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.extra}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="", help="variant A's variables, K=V[,K=V...] ('' = defaults)")
    ap.add_argument("--b", default="", help="variant B's variables")
    ap.add_argument("--model", default=D)
    ap.add_argument("--per", type=int, default=1, help="sentences per request")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every worker")
    args = ap.parse_args(argv)
    variants = {"A": parse_env(args.a), "B": parse_env(args.b)}
    threads = str(args.threads)
    os.environ.update({"SIE_TORCH_THREADS": threads, "OMP_NUM_THREADS": threads, "SIE_HF_OFFLINE": "1"})
    texts = sentences(512, 32, seed=1)

    def load(url: str, seconds: float) -> tuple[float, float, float]:
        return run_load(url, texts, args.per, args.clients, seconds, model=args.model, extra_headers=OFF)

    results: dict[str, list[tuple[float, float, float]]] = {"serve": [], "A": [], "B": []}
    with (
        tempfile.TemporaryDirectory(prefix="sie-bench-ab-") as tmp,
        ServeProcess(env={"SIE_TORCH_THREADS": threads, "SIE_PRELOAD_MODELS": args.model}) as server,
    ):
        clusters: dict[str, VariantCluster] = {}
        try:
            for name, extra in variants.items():
                clusters[name] = VariantCluster(
                    state_dir=Path(tmp) / name,
                    **free_cluster_ports(),
                    preload=args.model,
                    extra=extra,
                )
                clusters[name].start(say=lambda line: None)
            urls = {"serve": server.url, **{name: c.gateway_url for name, c in clusters.items()}}
            for url in urls.values():  # warm-up: shapes, connections, lanes
                load(url, 2.0)
            print(
                f"A = {variants['A'] or 'defaults'}, B = {variants['B'] or 'defaults'}; {args.model}, "
                f"{args.per}/req x {args.clients} clients, {args.rounds} rounds x {args.seconds:.0f} s "
                "(items/s, p50/p99 ms, ratio to sie serve in the same round)",
                flush=True,
            )
            for rnd in range(args.rounds):
                order = ["serve", "A", "B"] if rnd % 2 == 0 else ["serve", "B", "A"]
                got = {name: load(urls[name], args.seconds) for name in order}
                for name, r in got.items():
                    results[name].append(r)
                s = got["serve"]
                cells = [
                    f"{k} {got[k][0]:7.1f} ({got[k][0] / s[0]:.2f}x) {got[k][1]:6.1f}/{got[k][2]:6.1f}"
                    for k in "AB"
                ]
                print(
                    f"round {rnd + 1}: serve {s[0]:7.1f} {s[1]:6.1f}/{s[2]:6.1f} | " + " | ".join(cells),
                    flush=True,
                )
        finally:
            for c in clusters.values():
                c.stop()
    for name in "AB":
        ratios = [r[0] / s[0] for r, s in zip(results[name], results["serve"], strict=True)]
        wins = sum(
            1 for a, b in zip(results[name], results["B" if name == "A" else "A"], strict=True) if a[0] > b[0]
        )
        print(
            f"{name}: ratio mean {statistics.mean(ratios):.3f}, lowest {min(ratios):.3f}; "
            f"ahead of the other in {wins} of {len(ratios)} rounds"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
