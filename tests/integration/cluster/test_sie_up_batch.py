"""The OpenAI Batch API through ``sie up`` with the real ``openai`` client (issue 34): a batch whose
gateway is killed with SIGKILL in the middle finishes after ``sie up`` restarts it, with every line
in the output once and every vector equal to a direct encode of its input.

The default run sends 3,000 lines to the zero-cost model; the 10,000-line run with MiniLM is behind
``slow``:

    .venv/bin/python -m pytest -m slow -s tests/integration/cluster/test_sie_up_batch.py
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from tests.support.sie_up import SieUp

openai = pytest.importorskip("openai")

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _until(what: str, check, timeout_s: float):
    """Poll ``check`` (connection errors while the gateway restarts count as not yet)."""
    deadline = time.monotonic() + timeout_s  # generous: only guards against a hang
    while time.monotonic() < deadline:
        try:
            got = check()
        except (openai.APIConnectionError, openai.InternalServerError):
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout_s} s")


def run_batch_through_a_gateway_kill(tmp_path, model: str, lines: int, texts: int, timeout_s: float) -> None:
    up = SieUp(tmp_path / "state", preload=model)
    up.env.update({"SIE_BATCH_LEASE_S": "3", "SIE_BATCH_CHUNK_LINES": "100"})
    try:
        up.start()
        client = openai.OpenAI(base_url=up.gateway + "/v1", api_key="-", max_retries=5)
        corpus = [
            f"batch text number {i % texts}" for i in range(lines)
        ]  # repeats: computed once per request
        content = b"".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": model, "input": t},
                }
            ).encode()
            + b"\n"
            for i, t in enumerate(corpus)
        )
        uploaded = client.files.create(file=("corpus.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        _until(
            "a fifth of the lines",
            lambda: client.batches.retrieve(batch.id).request_counts.completed >= lines // 5,
            timeout_s,
        )
        victim = up.children()["gateway"]["pid"]
        os.kill(victim, signal.SIGKILL)
        done = _until(
            "the batch's end",
            lambda: (
                (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "cancelled") and b
            ),
            timeout_s,
        )
        assert done.status == "completed", done
        assert up.children()["gateway"]["restarts"] >= 1 and up.children()["gateway"]["pid"] != victim
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            lines,
            lines,
            0,
        )
        out = [json.loads(line) for line in client.files.content(done.output_file_id).content.splitlines()]
        ids = [o["custom_id"] for o in out]
        assert len(ids) == lines and set(ids) == {f"line-{i}" for i in range(lines)}  # none lost, none twice
        got = {o["custom_id"]: np.asarray(o["response"]["body"]["data"][0]["embedding"]) for o in out}
        distinct = sorted(set(corpus))
        direct: dict[str, np.ndarray] = {}
        for k in range(0, len(distinct), 64):
            part = distinct[k : k + 64]
            rows = client.embeddings.create(model=model, input=part, encoding_format="float").data
            direct.update({t: np.asarray(r.embedding) for t, r in zip(part, rows, strict=True)})
        worst = min(
            float(
                got[f"line-{i}"] @ direct[t] / (np.linalg.norm(got[f"line-{i}"]) * np.linalg.norm(direct[t]))
            )
            for i, t in enumerate(corpus)
        )
        assert worst >= 0.9999, worst
        print(f"batch of {lines} lines through a gateway kill: completed, min cosine {worst:.6f}")
    finally:
        print(up.stop()[-3000:])


def test_a_batch_survives_a_gateway_kill_under_sie_up(tmp_path):
    run_batch_through_a_gateway_kill(tmp_path, "sie-fake", lines=3000, texts=2500, timeout_s=300)


@pytest.mark.slow
def test_ten_thousand_lines_of_minilm_through_a_gateway_kill(tmp_path):
    run_batch_through_a_gateway_kill(tmp_path, MINILM, lines=10_000, texts=10_000, timeout_s=1800)
