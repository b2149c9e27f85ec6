"""Our SDK against ``sie serve`` (the standalone worker, real all-MiniLM-L6-v2 and the
deterministic ``sie-fake`` with its fault-injection profiles), sync and async."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("worker.serve", reason="worker.serve (sie serve) cannot be imported here")

from sdk import (  # noqa: E402
    ModelLoadFailedError,
    RequestError,
    SIEAsyncClient,
    SIEClient,
)
from tests.support.serve import ServeProcess  # noqa: E402

D = "sentence-transformers/all-MiniLM-L6-v2"
FAKE = "sie-fake"
TEXTS = ["A cat sits on the mat.", "A kitten rests on a rug.", "Interest rates rose again this quarter."]


@pytest.fixture(scope="module")
def server():
    srv = ServeProcess(env={"SIE_PRELOAD_MODELS": f"{D},{FAKE}"})
    srv.start(timeout=240)
    try:
        yield srv
    finally:
        srv.stop()


async def _async_encode(url: str, items, **kw):
    async with SIEAsyncClient(url) as client:
        return await client.encode(D, items, **kw)


def test_sync_and_async_give_equal_real_vectors(server):
    items = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
    with SIEClient(server.url) as client:
        sync = client.encode(D, items)
        single = client.encode(D, {"text": TEXTS[0]})
    asynchronous = asyncio.run(_async_encode(server.url, items))
    assert [r["id"] for r in sync] == ["t0", "t1", "t2"]
    for s, a in zip(sync, asynchronous, strict=True):
        assert s["dense"].dtype == np.float32 and s["dense"].shape == (384,)
        assert s["model"] == D
        np.testing.assert_array_equal(s["dense"], a["dense"])
    np.testing.assert_allclose(single["dense"], sync[0]["dense"], rtol=1e-5, atol=1e-6)
    # real sentence embeddings: the two animal sentences are closer than the finance one
    vecs = np.stack([r["dense"] / np.linalg.norm(r["dense"]) for r in sync])
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.2


def test_models_listing(server):
    with SIEClient(server.url) as client:
        names = {m["name"]: m for m in client.list_models()}
        assert names[D]["dims"]["dense"] == 384
        assert client.get_model(D)["dims"]["dense"] == 384
        with pytest.raises(RequestError) as info:
            client.get_model("no/such-model")
        assert info.value.status_code == 404


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_errors_surface_as_typed_exceptions(server, kind):
    async def run_async(call):
        async with SIEAsyncClient(server.url) as client:
            return await call(client)

    def run(call):
        if kind == "sync":
            with SIEClient(server.url) as client:
                return call(client)
        return asyncio.run(run_async(call))

    with pytest.raises(RequestError) as info:
        run(lambda c: c.encode("no/such-model", {"text": "x"}, provision_timeout_s=5))
    assert (info.value.status_code, info.value.code) == (404, "MODEL_NOT_FOUND")

    with pytest.raises(RequestError) as info:
        run(lambda c: c.encode(D, [], provision_timeout_s=5))
    assert (info.value.status_code, info.value.code) == (400, "INVALID_INPUT")

    with pytest.raises(RequestError) as info:
        run(lambda c: c.encode(D, {"text": "x"}, output_types=["sparse"], provision_timeout_s=5))
    assert (info.value.status_code, info.value.code) == (400, "INVALID_INPUT")

    with pytest.raises(RequestError) as info:
        run(lambda c: c.score(D, {"text": "q"}, [{"text": "d"}], provision_timeout_s=5))
    assert info.value.status_code == 400

    with pytest.raises(ModelLoadFailedError) as info:
        run(lambda c: c.encode(f"{FAKE}:fail-load", {"text": "x"}, provision_timeout_s=60))
    assert (info.value.status_code, info.value.code) == (502, "MODEL_LOAD_FAILED")
    assert isinstance(info.value.permanent, bool) and info.value.attempts >= 1

    with pytest.raises(RequestError) as info:
        run(lambda c: c.get_capacity())  # a worker is not a gateway


def test_cold_load_is_retried_until_the_model_is_ready(server):
    with SIEClient(server.url) as client:
        result = client.encode(f"{FAKE}:slow-load", {"text": "hello"}, provision_timeout_s=60)
        assert result["dense"].shape == (384,)
        assert client.last_retry_count >= 1


def test_score_and_extract_shapes_on_the_fake_model(server):
    with SIEClient(server.url) as client:
        scored = client.score(FAKE, {"text": "q", "id": "q"}, [{"id": "a", "text": "x"}, {"text": "y"}])
        assert scored["query_id"] == "q"
        assert sorted(s["rank"] for s in scored["scores"]) == [0, 1]
        assert {s["item_id"] for s in scored["scores"]} == {"a", "item-1"}
        extracted = client.extract(FAKE, [{"text": "Ada Lovelace"}, {"text": "Bob"}], labels=["person"])
        assert len(extracted) == 2 and all(isinstance(r["entities"], list) for r in extracted)
