"""The GPU benchmark's script, end to end on the CPU (``--smoke``: tiny random models, one short
round): a GPU lease is short, and a benchmark that breaks on its first row spends it for nothing.
Slow (a minute or more: it starts ``sie serve`` and a cluster), so outside ``make test``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.serve import REPO

pytestmark = pytest.mark.slow


def test_the_gpu_benchmark_runs_through_on_the_cpu():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.benchmarks.gpu",
            "--smoke",
            "--only",
            "MiniLM 32",
            "--no-inprocess",
            "--cluster-env",
            "|SIE_BATCHER_MAX_BATCH_WAIT_MS=5",
            "--cluster-pods",
            "1x2",  # a pod of two model processes, as on a GPU (4 there)
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "failed" not in out, out[-3000:]
    # the table: sie serve, then a cluster per --cluster-env variant (measured in turn)
    rows = re.findall(
        r"^(serve x1|cluster 1x2 v\d)\s+MiniLM 32 tok, 1/req x 64 clients\s+([\d.]+)", out, re.M
    )
    assert [r[0] for r in rows] == ["serve x1", "cluster 1x2 v1", "cluster 1x2 v2"], out[-3000:]
    assert all(float(rate) > 0 for _, rate in rows)
    # every measured round says where the CPU went; the cluster's also its pods' forwards
    assert re.search(r"CPU cores: clients [\d.]+, sie serve [\d.]+", out)
    assert re.search(r"CPU cores: clients .*gateway [\d.]+; pods' forwards: [\d.]+ ms/item, busy [\d.]+", out)
    cosines = [float(c) for c in re.findall(r"min cosine ([\d.]+)", out)]
    assert len(cosines) == 2 and min(cosines) > 0.999
