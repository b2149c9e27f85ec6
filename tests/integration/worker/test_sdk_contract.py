"""Contract section 10 checks 1, 2, 4, 8, 13–15, 28 and 30: the public sie-sdk 0.10.1 against ``sie serve``."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.support.sdk312 import run_sdk
from tests.support.serve import ServeProcess
from worker.models.precision import cpu_has_native_bf16

D = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server():
    with ServeProcess(env={"SIE_PRELOAD_MODELS": D}) as srv:
        yield srv


def test_checks_1_2_4_8_13_14_15_with_public_sdk(server, sdk):
    out = run_sdk(
        """
        import numpy as np
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import RequestError
        res = {}
        with SIEClient(URL) as c:
            r = c.encode(__D__, {"text": "hello"})
            res["c1"] = [type(r).__name__, type(r["dense"]).__name__, str(r["dense"].dtype),
                         list(r["dense"].shape), r["model"]]
            rs = c.encode(__D__, [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}, {"text": "z"}])
            once = c.encode(__D__, {"text": "x"})
            twice = c.encode(__D__, {"text": "x"})
            # alone vs in a batch of three: the same vector up to BLAS blocking order
            res["c2"] = [len(rs), rs[0].get("id"), rs[1].get("id"), "id" in rs[2],
                         bool(np.array_equal(once["dense"], twice["dense"])),
                         bool(np.allclose(rs[0]["dense"], once["dense"], atol=1e-6, rtol=0))]
            f32 = c.encode(__D__, {"text": "quantise me"})["dense"]
            q = {}
            for dt in ["float16", "int8", "uint8", "binary"]:
                v = c.encode(__D__, {"text": "quantise me"}, output_dtype=dt)["dense"]
                q[dt] = [str(v.dtype), list(v.shape), int(np.abs(v.astype(np.int32)).max()),
                         int(v.astype(np.int32).min())]
            q["binary_equal"] = bool(np.array_equal(
                c.encode(__D__, {"text": "quantise me"}, output_dtype="binary")["dense"], np.packbits(f32 > 0)))
            res["c4"] = q
            errs = {}
            for name, call in [
                ("c8", lambda: c.encode(__D__, {"text": "x"}, output_types=["sparse"])),
                ("c14_encode", lambda: c.encode("no/such-model", {"text": "x"}, provision_timeout_s=5)),
                ("c14_get", lambda: c.get_model("no/such-model")),
                ("c15", lambda: c.encode(__D__, [])),
            ]:
                try:
                    call()
                    errs[name] = None
                except RequestError as e:
                    errs[name] = [type(e).__name__, e.status_code, e.code]
            res["errors"] = errs
            models = c.list_models()
            entry = [m for m in models if m["name"] == __D__][0]
            res["c13"] = [all(set(["name", "inputs", "outputs", "dims", "loaded"]) <= set(m) for m in models),
                          entry["dims"]["dense"], entry["loaded"]]
        print(json.dumps(res))
        """.replace("__D__", repr(D)),
        server.url,
    )
    assert out["c1"] == ["dict", "ndarray", "float32", [384], D]
    assert out["c2"] == [3, "a", "b", False, True, True]
    q = out["c4"]
    assert q["float16"][:2] == ["float16", [384]]
    assert q["int8"][0] == "int8" and q["int8"][2] == 127
    assert q["uint8"][0] == "uint8" and q["uint8"][2] == 255 and q["uint8"][3] == 0
    assert q["binary"][:2] == ["uint8", [48]] and q["binary_equal"] is True
    assert out["errors"]["c8"] == ["RequestError", 400, "INVALID_INPUT"]
    assert out["errors"]["c14_encode"][1:] == [404, "MODEL_NOT_FOUND"]
    assert out["errors"]["c14_get"][1] == 404
    assert out["errors"]["c15"][1:] == [400, "INVALID_INPUT"]
    assert out["c13"] == [True, 384, True]


def test_check_15_raw_garbage_gets_json_400(server):
    r = httpx.post(
        f"{server.url}/v1/encode/{D}",
        content=b"\xc1\xc1garbage",
        headers={"Content-Type": "application/msgpack"},
    )
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["detail"]["code"] == "INVALID_INPUT"


def test_check_28_openai_embeddings(server):
    native = httpx.post(
        f"{server.url}/v1/encode/{D}",
        json={"items": [{"text": "a"}, {"text": "b"}]},
        headers={"Accept": "application/json"},
    ).json()
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": D, "input": ["a", "b"]})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, item in zip(body["data"], native["items"], strict=True):
        assert len(d["embedding"]) == 384
        np.testing.assert_allclose(d["embedding"], item["dense"]["values"], rtol=0, atol=1e-6)
    b64 = httpx.post(
        f"{server.url}/v1/embeddings", json={"model": D, "input": "a", "encoding_format": "base64"}
    )
    vec = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, native["items"][0]["dense"]["values"], rtol=0, atol=1e-6)
    short = httpx.post(
        f"{server.url}/v1/embeddings", json={"model": D, "input": ["a", "b"], "dimensions": 64}
    )
    for d, item in zip(
        short.json()["data"], native["items"], strict=True
    ):  # Matryoshka: truncated, re-normalised
        head = np.asarray(item["dense"]["values"][:64])
        np.testing.assert_allclose(d["embedding"], head / np.linalg.norm(head), rtol=0, atol=1e-6)
    listed = httpx.get(f"{server.url}/v1/models").json()
    assert D in [m["id"] for m in listed["data"]] and D in [m["name"] for m in listed["models"]]
    # the precision the loaded model computes in: its float32 profile in bf16 where the CPU has it natively
    entry = next(m for m in listed["models"] if m["name"] == D)
    assert entry["precision"] == ("bfloat16" if cpu_has_native_bf16() else "float32"), entry
    assert httpx.get(f"{server.url}/v1/models/{D}").json()["precision"] == entry["precision"]
    bad = httpx.post(f"{server.url}/v1/embeddings", json={"model": D, "input": "a", "dimensions": 385})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_field"
    missing = httpx.post(f"{server.url}/v1/embeddings", json={"model": "no/such", "input": "a"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_check_30_json_fallback(server):
    r = httpx.post(
        f"{server.url}/v1/encode/{D}",
        json={"items": [{"text": "json please"}]},
        headers={"Accept": "application/json"},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    values = r.json()["items"][0]["dense"]["values"]
    assert isinstance(values, list) and len(values) == 384
    err = httpx.post(
        f"{server.url}/v1/encode/no/such",
        json={"items": [{"text": "x"}]},
        headers={"Accept": "application/json"},
    )
    assert err.status_code == 404 and "detail" in err.json()


def test_watch_status_stream_and_index_with_public_sdk(server, sdk):
    """``watch()`` (contract 5.5) against ``sie serve``: /ws/status frames, then ``GET /``."""
    out = run_sdk(
        """
        import itertools, json
        from sie_sdk import SIEClient
        with SIEClient(URL) as c:
            frames = [dict(m) if isinstance(m, dict) else getattr(m, "__dict__", m)
                      for m in itertools.islice(c.watch(mode="worker"), 3)]
        print(json.dumps({"frames": [json.loads(json.dumps(f, default=str)) for f in frames]}))
        """,
        server.url,
    )
    frames = out["frames"]
    assert len(frames) == 3
    assert all(f["ready"] is True and D in f["loaded_models"] and f["server"]["pid"] > 0 for f in frames)
    assert frames[0]["timestamp"] <= frames[2]["timestamp"]
    index = httpx.get(server.url + "/").json()
    assert index["type"] == "worker" and "/ws/status" in index["routes"]


def test_our_sdk_watch_and_wait_for_capacity_against_serve(server):
    """Our SDK's ``watch()``/``wait_for_capacity()`` behave as the public SDK's on a worker: auto mode
    finds /ws/status; capacity needs a gateway, so the wait ends in ProvisioningError."""
    import asyncio
    import itertools

    from sdk import ProvisioningError, RequestError, SIEAsyncClient, SIEClient

    with SIEClient(server.url) as c:
        frames = list(itertools.islice(c.watch(), 3))
        assert all(f["ready"] is True and D in f["loaded_models"] for f in frames)
        assert frames[0]["timestamp"] <= frames[2]["timestamp"]
        with pytest.raises(ProvisioningError) as exc:
            c.wait_for_capacity("cpu", timeout_s=0.5, poll_interval_s=0.1)
        assert exc.value.gpu == "cpu" and "waiting for GPU 'cpu' capacity" in str(exc.value)
        with pytest.raises(RequestError) as refused:  # a worker has no /ws/cluster-status
            next(c.watch(mode="cluster"))
        assert refused.value.status_code == 404

    async def first_async_frame() -> dict:
        async with SIEAsyncClient(server.url) as ac:
            async for frame in ac.watch(mode="worker"):
                return frame
        raise AssertionError("no frame")

    assert D in asyncio.run(first_async_frame())["loaded_models"]
