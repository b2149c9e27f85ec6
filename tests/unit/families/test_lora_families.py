"""LoRA on every family with a transformer body: our forward with a loaded LoRA equals peft's
PeftModel computed directly, and the base model is back without it (packed path included)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.support.typed import inputs
from tests.unit.families import checkpoints as ck
from tests.unit.families.conftest import loaded_adapter
from worker.adapters.base import RequestContext
from worker.adapters.cross_encoder import CrossEncoderAdapter
from worker.adapters.sparse import SpladeAdapter, splade_vectors

SPLADE = Path(importlib.util.find_spec("cognition").submodule_search_locations[0]) / "model"
TEXTS = ["low rank adapters change the weights", "short", "a third text"]


def adapter(cls, path: Path, packed: bool):
    return loaded_adapter(cls, path, {"packed": packed})


def save_lora(model_cls, path: Path, dest: Path) -> Path:
    torch.manual_seed(5)
    base = model_cls.from_pretrained(str(path))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(dest))
    return dest


@pytest.mark.parametrize("packed", [True, False])
def test_splade_lora_equals_peft(tmp_path, packed):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    lora = save_lora(AutoModelForMaskedLM, SPLADE, tmp_path / "lora")
    a = adapter(SpladeAdapter, SPLADE, packed)
    a.load_lora("l1", str(lora))
    tok = AutoTokenizer.from_pretrained(str(SPLADE))
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    peft_model = PeftModel.from_pretrained(
        AutoModelForMaskedLM.from_pretrained(str(SPLADE)), str(lora)
    ).eval()
    with torch.no_grad():
        ref = splade_vectors(peft_model(**batch).logits, batch["attention_mask"]).numpy()
        base = splade_vectors(
            AutoModelForMaskedLM.from_pretrained(str(SPLADE)).eval()(**batch).logits, batch["attention_mask"]
        ).numpy()
    for lora_name, expected in (("l1", ref), (None, base)):
        ctx = RequestContext(op="encode", output_types=("sparse",), lora=lora_name)
        out = a.forward(ctx, a.prepare(ctx, inputs([{"text": t} for t in TEXTS])))
        for row, o in zip(expected, out, strict=True):
            idx, val = o["sparse"]
            np.testing.assert_array_equal(idx, np.flatnonzero(row))
            np.testing.assert_allclose(val, row[idx], atol=1e-4, rtol=1e-5)
    assert not np.allclose(ref, base, atol=1e-3)  # the LoRA really changes the output


@pytest.mark.parametrize("packed", [True, False])
def test_cross_encoder_lora_equals_peft(tmp_path, packed):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = ck.build_cross_encoder(tmp_path / "ce", steps=5)
    lora = save_lora(AutoModelForSequenceClassification, path, tmp_path / "lora")
    a = adapter(CrossEncoderAdapter, path, packed)
    a.load_lora("l1", str(lora))
    tok = AutoTokenizer.from_pretrained(str(path))
    batch = tok(["what is ml"] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    peft_model = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(str(path)), str(lora)
    ).eval()
    with torch.no_grad():
        ref = torch.sigmoid(peft_model(**batch).logits[:, 0]).numpy()
        base = torch.sigmoid(
            AutoModelForSequenceClassification.from_pretrained(str(path)).eval()(**batch).logits[:, 0]
        ).numpy()
    pairs = [({"text": "what is ml"}, {"text": t}) for t in TEXTS]
    for lora_name, expected in (("l1", ref), (None, base)):
        ctx = RequestContext(op="score", lora=lora_name)
        np.testing.assert_allclose(a.forward(ctx, a.prepare(ctx, inputs(pairs))), expected, atol=1e-5)
    assert not np.allclose(ref, base, atol=1e-4)
