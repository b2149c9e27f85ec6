"""MiniLM through ``sie serve`` in float32 and in bfloat16 on this CPU (SIE_CPU_PRECISION), interleaved.

``python -m tests.benchmarks.cpu_precision [--rounds 3] [--seconds 20]``: two servers, one per
setting, started once; each round loads the float32 one, then the bf16 one, with the same texts
(32 sentences of about 32 tokens per request, 4 clients), and prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import urllib.request

from tests.benchmarks.load import run_load
from tests.benchmarks.run import D, mixed_sentences, sentences
from tests.support.serve import ServeProcess
from worker.models.precision import cpu_has_native_bf16


def precision_of(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models/{D}", timeout=10) as resp:
        return str(json.load(resp)["precision"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2, help="SIE_TORCH_THREADS of each server")
    ap.add_argument("--mixed", action="store_true", help="mixed 8-256 token sentences instead of ~32")
    args = ap.parse_args(argv)
    texts = mixed_sentences(512, seed=2) if args.mixed else sentences(512, 32, seed=1)
    env = {
        "SIE_TORCH_THREADS": str(args.threads),
        "OMP_NUM_THREADS": str(args.threads),
        "SIE_PRELOAD_MODELS": D,
    }
    print(f"native bf16 on this CPU: {cpu_has_native_bf16()}")
    with (
        ServeProcess(env={**env, "SIE_CPU_PRECISION": "float32"}) as fp32,
        ServeProcess(env={**env, "SIE_CPU_PRECISION": "bfloat16"}) as bf16,
    ):
        servers = {"float32": fp32, "bfloat16": bf16}
        for name, srv in servers.items():
            assert precision_of(srv.url) == name, (name, precision_of(srv.url))
            run_load(srv.url, texts, 32, 4, 2.0, model=D)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for r in range(args.rounds):
            for name, srv in servers.items():
                rate, p50, p99 = run_load(srv.url, texts, 32, 4, args.seconds, model=D)
                rates[name].append(rate)
                print(
                    f"round {r + 1} {name:8s}: {rate:7.1f} sentences/s  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms"
                )
            print(f"round {r + 1} bf16/fp32: {rates['bfloat16'][-1] / rates['float32'][-1]:.2f}x", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(
        f"medians: float32 {med['float32']:.1f}/s, bfloat16 {med['bfloat16']:.1f}/s, {med['bfloat16'] / med['float32']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
