"""Zero-shot classification in ``extract`` (an NLI cross-encoder, labels per request) against
transformers' own zero-shot pipeline on the same tiny checkpoint; through ``sie serve`` with our SDK."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, pipeline

from sdk import SIEClient
from tests.support.serve import ServeProcess
from tests.support.typed import inputs
from tests.unit.families import checkpoints as ck
from tests.unit.families.conftest import loaded_adapter
from worker.adapters.base import RequestContext
from worker.adapters.zero_shot import ZeroShotAdapter

TEXTS = ["The team won the final match last night.", "Stocks fell sharply after the bank's report."]
LABELS = ["sports", "finance", "cooking"]


@pytest.fixture(scope="module")
def nli(tmp_path_factory):
    dest = tmp_path_factory.mktemp("nli")
    torch.manual_seed(3)
    tok = AutoTokenizer.from_pretrained(str(ck.BACKBONE))
    cfg = BertConfig.from_pretrained(str(ck.BACKBONE), num_labels=3,
                                     id2label={0: "contradiction", 1: "neutral", 2: "entailment"},
                                     label2id={"contradiction": 0, "neutral": 1, "entailment": 2})  # fmt: skip
    BertForSequenceClassification(cfg).eval().save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    return dest


def adapter(path) -> ZeroShotAdapter:
    return loaded_adapter(ZeroShotAdapter, path, max_len=128)


@pytest.mark.parametrize("multi", [False, True])
def test_scores_equal_the_transformers_pipeline(nli, multi):
    a = adapter(nli)
    ctx = RequestContext(
        op="extract",
        labels=tuple(LABELS),
        options_json=RequestContext.canonical_options({"multi_label": multi}),
    )
    got = a.forward(ctx, a.prepare(ctx, inputs([{"text": t} for t in TEXTS])))
    pipe = pipeline("zero-shot-classification", model=str(nli), tokenizer=str(nli), device="cpu")
    for text, out in zip(TEXTS, got, strict=True):
        want = pipe(text, candidate_labels=LABELS, multi_label=multi)
        # per label (a random checkpoint this tiny can tie two labels to the last bit, and the
        # pipeline breaks ties in its own order), then ours is highest first
        ours = {c["label"]: c["score"] for c in out["classifications"]}
        assert ours == pytest.approx(dict(zip(want["labels"], want["scores"], strict=True)), abs=1e-5)
        scores = [c["score"] for c in out["classifications"]]
        assert scores == sorted(scores, reverse=True) and len(scores) == len(LABELS)
    if not multi:
        assert all(sum(c["score"] for c in o["classifications"]) == pytest.approx(1.0) for o in got)


def test_zero_shot_through_sie_serve(nli, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "nli.yaml").write_text(json.dumps({
        "sie_id": "local/nli", "weights_path": str(nli), "inputs": {"text": True}, "tasks": {"extract": {}},
        "max_sequence_length": 128,
        "profiles": {"default": {"adapter_path": "worker.adapters.zero_shot:ZeroShotAdapter", "max_batch_tokens": 4096}},
    }))  # fmt: skip
    with ServeProcess(env={"SIE_MODELS_DIR": str(models)}) as srv, SIEClient(srv.url) as client:
        res = client.extract(
            "local/nli",
            [{"text": t} for t in TEXTS],
            labels=LABELS,
            options={"hypothesis_template": "This text is about {}."},
        )
        assert len(res) == 2
        for item in res:
            assert sorted(c["label"] for c in item["classifications"]) == sorted(LABELS)
        with pytest.raises(Exception) as no_labels:
            client.extract("local/nli", {"text": TEXTS[0]})
        assert "labels" in str(no_labels.value)
