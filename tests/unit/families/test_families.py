"""Each family through the Runtime, compared with the same computation done directly with
transformers / gliner on the same local checkpoint (cosine ≥ 0.9999 in fp32)."""

from __future__ import annotations

import string

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertModel

from protocol.errors import ErrorCode, SIEError
from tests.support.vectors import cosines
from worker.runtime.muvera import MuveraConfig, fde

TEXTS = [
    "ColBERT encodes every token of a passage.",
    "Short one!",
    "Late interaction keeps one vector per token, then scores with MaxSim over the query tokens; "
    "MUVERA turns the token set into one fixed-size vector.",
]


# ---- ColBERT -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colbert_direct(family_checkpoints):
    path = str(family_checkpoints["colbert"])
    tok = AutoTokenizer.from_pretrained(path)
    bert = BertModel.from_pretrained(path, attn_implementation="eager").eval()
    weight = load_file(f"{path}/model.safetensors")["linear.weight"]
    punct = {tok.encode(c, add_special_tokens=False)[0] for c in string.punctuation}

    @torch.no_grad()
    def run(text: str, is_query: bool) -> np.ndarray:
        length = 32 if is_query else 180
        ids = tok(text, truncation=True, max_length=length - 1)["input_ids"]
        ids = [ids[0], tok.convert_tokens_to_ids("[unused0]" if is_query else "[unused1]"), *ids[1:]]
        n = len(ids)
        attn = [1] * n
        if is_query:
            ids += [tok.mask_token_id] * (length - n)
            attn += [0] * (length - n)
        hidden = bert(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([attn])).last_hidden_state[0]
        vecs = torch.nn.functional.normalize(hidden @ weight.T, dim=-1)
        if not is_query:
            vecs = vecs[[i for i in range(n) if ids[i] not in punct]]
        return vecs.numpy()

    return run


@pytest.mark.parametrize("is_query", [False, True])
def test_colbert_multivector_equals_direct(family_runtime, colbert_direct, is_query):
    items = [{"text": t, "id": f"t{i}"} for i, t in enumerate(TEXTS)]
    res = family_runtime.call(
        "encode", "local/colbert", items, {"output_types": ["multivector"], "options": {"is_query": is_query}}
    )
    for item, text in zip(res.items, TEXTS, strict=True):
        mv = item["multivector"]
        got, want = mv["values"], colbert_direct(text, is_query)
        assert got.shape == want.shape and mv["token_dims"] == 96 and mv["num_tokens"] == want.shape[0]
        assert cosines(got, want).min() >= 0.9999
    if is_query:  # query augmentation: every query has the full query length
        assert {item["multivector"]["num_tokens"] for item in res.items} == {32}


def test_colbert_muvera_profile(family_runtime, colbert_direct):
    items = [{"text": t} for t in TEXTS]
    res = family_runtime.call("encode", "local/colbert:muvera", items, {"output_types": ["dense"]})
    cfg = MuveraConfig()
    lengths = {item["dense"]["values"].shape for item in res.items}
    assert lengths == {(cfg.output_dim(96),)} and all("multivector" not in it for it in res.items)
    for item, text in zip(res.items, TEXTS, strict=True):
        want = fde(colbert_direct(text, False), cfg, is_query=False)
        assert item["dense"]["dims"] == cfg.output_dim(96) and item["dense"]["values"].dtype == np.float32
        assert cosines(item["dense"]["values"], want) >= 0.9999
    # request options overlay the profile's MUVERA config; queries sum per bucket
    res = family_runtime.call(
        "encode",
        "local/colbert",
        [{"text": TEXTS[0]}],
        {
            "output_types": ["dense"],
            "options": {"profile": "muvera", "is_query": True, "muvera": {"num_repetitions": 2}},
        },
    )
    small = MuveraConfig(num_repetitions=2)
    want = fde(colbert_direct(TEXTS[0], True), small, is_query=True)
    assert cosines(res.items[0]["dense"]["values"], want) >= 0.9999
    # the default profile has no dense output: MUVERA must be asked for through the profile
    with pytest.raises(SIEError) as err:
        family_runtime.call("encode", "local/colbert", [{"text": "x"}], {"output_types": ["dense"]})
    assert err.value.code == ErrorCode.INVALID_INPUT


def test_colbert_score_is_maxsim(family_runtime, colbert_direct):
    query = {"text": "what is late interaction", "id": "q"}
    res = family_runtime.call("score", "local/colbert", query, [{"text": t} for t in TEXTS])
    q = colbert_direct(query["text"], True)
    want = [float((q @ colbert_direct(t, False).T).max(axis=1).sum()) for t in TEXTS]
    got = {e["item_id"]: e["score"] for e in res.items}
    assert [e["rank"] for e in res.items] == [0, 1, 2] and res.query_id == "q"
    for i, w in enumerate(want):
        assert got[f"item-{i}"] == pytest.approx(w, rel=1e-4)
    assert [e["item_id"] for e in res.items] == [f"item-{i}" for i in np.argsort(-np.array(want))]


# ---- cross-encoder -------------------------------------------------------------------------
def test_cross_encoder_scores_equal_direct(family_runtime, family_checkpoints):
    path = str(family_checkpoints["cross_encoder"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    query = "what is ML"
    docs = [
        {"id": "d1", "text": "Python is a snake"},
        {"id": "d2", "text": "Machine learning is a field of AI"},
        {"text": "Paris is the capital of France, a country in western Europe with a long history."},
    ]
    res = family_runtime.call("score", "local/reranker", {"text": query, "id": "q"}, docs)
    with torch.no_grad():
        enc = tok([query] * 3, [d["text"] for d in docs], padding=True, return_tensors="pt")
        want = torch.sigmoid(model(**enc).logits[:, 0]).tolist()
    got = {e["item_id"]: e["score"] for e in res.items}
    for key, w in zip(["d1", "d2", "item-2"], want, strict=True):
        assert got[key] == pytest.approx(w, rel=1e-5, abs=1e-6)
    assert [e["rank"] for e in res.items] == [0, 1, 2]
    assert [e["score"] for e in res.items] == sorted(got.values(), reverse=True)
    assert res.items[0]["item_id"] == "d2" and res.query_id == "q" and res.input_tokens > 0


def test_cross_encoder_matches_sentence_transformers(family_runtime, family_checkpoints):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(family_checkpoints["cross_encoder"]), device="cpu")
    pairs = [
        ("capital of France", "Paris is the capital of France"),
        ("capital of France", "Bananas are yellow"),
    ]
    want = ce.predict(pairs)
    res = family_runtime.call(
        "score", "local/reranker", {"text": pairs[0][0]}, [{"text": d} for _, d in pairs]
    )
    got = {e["item_id"]: e["score"] for e in res.items}
    assert got["item-0"] == pytest.approx(float(want[0]), rel=1e-5)
    assert got["item-1"] == pytest.approx(float(want[1]), rel=1e-5)


def test_cross_encoder_overflow_policy(family_runtime):
    long_doc = {"text": "word " * 800}
    res = family_runtime.call("score", "local/reranker", {"text": "q"}, [long_doc])
    assert res.input_tokens == 512
    with pytest.raises(SIEError) as err:
        family_runtime.call(
            "score", "local/reranker", {"text": "q"}, [long_doc], options={"overflow_policy": "error"}
        )
    assert err.value.code == ErrorCode.INPUT_TOO_LONG


# ---- sequence classification ---------------------------------------------------------------
def test_classifier_equals_direct(family_runtime, family_checkpoints):
    path = str(family_checkpoints["classifier"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    items = [{"text": t} for t in TEXTS]
    res = family_runtime.call("extract", "local/classifier", items, {})
    with torch.no_grad():
        enc = tok(TEXTS, padding=True, truncation=True, max_length=64, return_tensors="pt")
        probs = torch.softmax(model(**enc).logits, dim=-1).numpy()
    for i, item in enumerate(res.items):
        assert item["id"] == f"item-{i}" and item["entities"] == []
        cls = item["classifications"]
        assert [c["score"] for c in cls] == sorted((c["score"] for c in cls), reverse=True)
        by_label = {c["label"]: c["score"] for c in cls}
        for j, label in enumerate(["negative", "neutral", "positive"]):
            assert by_label[label] == pytest.approx(float(probs[i, j]), rel=1e-5)
    res = family_runtime.call("extract", "local/classifier", items[:1], {"labels": ["positive", "negative"]})
    assert {c["label"] for c in res.items[0]["classifications"]} == {"positive", "negative"}
    with pytest.raises(SIEError) as err:
        family_runtime.call("extract", "local/classifier", items[:1], {"labels": ["sarcastic"]})
    assert err.value.code == ErrorCode.INVALID_INPUT


# ---- BGE-M3 --------------------------------------------------------------------------------
def test_bge_m3_three_outputs_equal_direct(family_runtime, family_checkpoints):
    path = family_checkpoints["bge_m3"]
    tok = AutoTokenizer.from_pretrained(str(path))
    bert = BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    colbert = torch.load(path / "colbert_linear.pt", weights_only=True)
    sparse = torch.load(path / "sparse_linear.pt", weights_only=True)
    res = family_runtime.call(
        "encode",
        "local/bge-m3",
        [{"text": t} for t in TEXTS],
        {"output_types": ["dense", "sparse", "multivector"]},
    )
    special = {tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, tok.unk_token_id}
    for item, text in zip(res.items, TEXTS, strict=True):
        with torch.no_grad():
            ids = tok(text, return_tensors="pt")
            h = bert(**ids).last_hidden_state[0]
            dense = torch.nn.functional.normalize(h[0], dim=-1).numpy()
            weights = torch.relu(h @ sparse["weight"].T + sparse["bias"])[:, 0].numpy()
            mv = torch.nn.functional.normalize(h[1:] @ colbert["weight"].T + colbert["bias"], dim=-1).numpy()
        lexical: dict[int, float] = {}
        for t, w in zip(ids["input_ids"][0].tolist(), weights.tolist(), strict=True):
            if t not in special and w > lexical.get(t, 0.0):
                lexical[t] = w
        assert cosines(item["dense"]["values"], dense) >= 0.9999 and item["dense"]["dims"] == 128
        assert item["sparse"]["indices"].tolist() == sorted(lexical)
        np.testing.assert_allclose(item["sparse"]["values"], [lexical[k] for k in sorted(lexical)], rtol=1e-4)
        assert item["multivector"]["values"].shape == mv.shape
        assert cosines(item["multivector"]["values"], mv).min() >= 0.9999
    for profile in ("dense", "sparse", "multivector"):
        res = family_runtime.call("encode", f"local/bge-m3:{profile}", [{"text": "hi"}], {})
        assert set(res.items[0]) == {profile}


# ---- GLiNER --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gliner_direct(family_checkpoints):
    from gliner import GLiNER

    return GLiNER.from_pretrained(
        str(family_checkpoints["gliner"]), load_tokenizer=True, map_location="cpu"
    ).eval()


NER_TEXTS = [
    "Apple was founded by Steve Jobs.",
    "John Smith works at Microsoft in Redmond.",
    "Nothing to see here",
]


@pytest.mark.parametrize("threshold", [0.5, 0.05])
def test_gliner_entities_equal_predict_entities(family_runtime, gliner_direct, threshold):
    labels = ["person", "organization"]
    items = [{"text": t, **({"id": "first"} if i == 0 else {})} for i, t in enumerate(NER_TEXTS)]
    res = family_runtime.call(
        "extract", "local/gliner", items, {"labels": labels, "options": {"threshold": threshold}}
    )
    assert [it["id"] for it in res.items] == ["first", "item-1", "item-2"]
    found = 0
    for item, text in zip(res.items, NER_TEXTS, strict=True):
        want = gliner_direct.predict_entities(text, labels, threshold=threshold)
        got = item["entities"]
        assert [(e["text"], e["label"], e["start"], e["end"]) for e in got] == [
            (e["text"], e["label"], e["start"], e["end"]) for e in want
        ]
        for g, w in zip(got, want, strict=True):
            assert g["score"] == pytest.approx(w["score"], rel=1e-4, abs=1e-6)
            assert (
                text[g["start"] : g["end"]] == g["text"]
                and isinstance(g["score"], float)
                and g["bbox"] is None
            )
        assert item["relations"] == [] and item["classifications"] == [] and item["objects"] == []
        assert "error" not in item
        found += len(got)
    if threshold < 0.1:
        assert found > 0


def test_gliner_needs_labels_and_honours_overflow_policy(family_runtime):
    with pytest.raises(SIEError) as err:
        family_runtime.call("extract", "local/gliner", [{"text": "Apple"}], {})
    assert err.value.code == ErrorCode.INVALID_INPUT
    long_text = {"text": "Steve " * 200}
    res = family_runtime.call("extract", "local/gliner", [long_text], {"labels": ["person"]})
    assert res.items[0]["id"] == "item-0"
    with pytest.raises(SIEError) as err:
        family_runtime.call(
            "extract",
            "local/gliner",
            [long_text],
            {"labels": ["person"], "options": {"overflow_policy": "error"}},
        )
    assert err.value.code == ErrorCode.INPUT_TOO_LONG


def test_bad_muvera_options_are_refused_before_the_forward_pass(family_runtime):
    with pytest.raises(SIEError) as err:
        family_runtime.call(
            "encode",
            "local/colbert:muvera",
            [{"text": "x"}],
            {"output_types": ["dense"], "options": {"muvera": {"num_repetitions": -1}}},
        )
    assert err.value.code == ErrorCode.INVALID_INPUT and "num_repetitions" in err.value.message
