"""Visual-document retrievers (ColPali, ColQwen2): each catalog entry with its weights replaced by a
tiny random checkpoint of the same architecture (tests/support/colpali_models.py), through the
worker's runtime, against transformers run directly (the processor, then the model's
``embeddings`` masked to the attended positions) one item at a time: page images and text queries
as multi-vectors, MaxSim scores; a corrupt image answers 400 naming its item while a request
batched beside it is answered."""

from __future__ import annotations

import asyncio
import base64
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml

from protocol.errors import ErrorCode, SIEError
from tests.support.colpali_models import DIM, build_colpali, build_colqwen2
from tests.support.image_models import picture, png
from tests.support.typed import inputs, runtime_args
from tests.unit.families.conftest import loaded_adapter, runtime_serving
from worker.adapters.base import RequestContext
from worker.adapters.colpali import FAMILIES, ColPaliAdapter

REPO = Path(__file__).resolve().parents[3]
CASES = [("colpali-v1.3-hf.yaml", "colpali"), ("colqwen2-v1.0-hf.yaml", "colqwen2")]
QUERIES = ["what is the total?", "x"]
IMAGES = [picture(1), picture(2, (64, 64))]  # ColQwen2 gives these two different token counts


@pytest.fixture(scope="module", params=CASES, ids=[c[1] for c in CASES])
def served(request, tmp_path_factory):
    """(runtime, model id, checkpoint path, kind) for one catalog entry on its tiny checkpoint."""
    entry, kind = request.param
    root = tmp_path_factory.mktemp(kind)
    path = (build_colpali if kind == "colpali" else build_colqwen2)(root / "ckpt")
    data = yaml.safe_load((REPO / "worker" / "catalog" / "models" / entry).read_text())
    data["weights_path"] = str(path)
    data["tasks"]["encode"]["multivector"]["dim"] = DIM
    data["profiles"]["default"]["compute_precision"] = "float32"
    rt = runtime_serving(root / "models", yaml.safe_dump(data))
    yield rt, data["sie_id"], path, kind
    rt.close()


@functools.cache
def direct(path: Path, kind: str) -> tuple:
    model_name, processor_name = FAMILIES[kind]
    proc = getattr(transformers, processor_name).from_pretrained(str(path), backend="pil")
    model = getattr(transformers, model_name).from_pretrained(str(path), attn_implementation="sdpa").eval()
    return proc, model


def reference(path: Path, kind: str, item: dict) -> np.ndarray:
    """transformers alone: the processor on the one item, the model, the attended positions."""
    proc, model = direct(path, kind)
    enc = proc(images=[item["image"]]) if "image" in item else proc(text=[item["text"]])
    enc.pop("labels", None)
    with torch.no_grad():
        emb = model(**enc).embeddings[0]
    return emb[enc["attention_mask"][0].bool()].numpy()


def vectors(item: dict) -> np.ndarray:
    mv = item["multivector"]
    assert mv["token_dims"] == DIM and mv["num_tokens"] == mv["values"].shape[0]
    return np.asarray(mv["values"], dtype=np.float32)


def test_pages_and_queries_equal_transformers(served):
    rt, model, path, kind = served
    items = [
        {"images": [{"data": png(IMAGES[0]), "format": "png"}]},
        {"text": QUERIES[0]},
        {"images": [base64.b64encode(png(IMAGES[1])).decode()]},
        {"text": QUERIES[1]},
    ]
    result = rt.call("encode", model, items, {"output_types": ["multivector"]})
    refs = [{"image": IMAGES[0]}, {"text": QUERIES[0]}, {"image": IMAGES[1]}, {"text": QUERIES[1]}]
    shapes = []
    for got_item, ref_item in zip(result.items, refs, strict=True):
        got, ref = vectors(got_item), reference(path, kind, ref_item)
        assert got.shape == ref.shape
        cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
        assert cos.min() >= 0.9999, (kind, ref_item.keys(), cos.min())
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)  # normalised by the model
        shapes.append(got.shape[0])
    # a page: its image tokens plus the visual prompt; a query: prefix, text and 10 augmentation tokens
    assert shapes[0] > 16 and shapes[1] > 10 + len(QUERIES[0]) and shapes[3] < shapes[1]
    if kind == "colqwen2":
        assert shapes[0] != shapes[2]  # dynamic resolution: a larger page has more vectors
    else:
        assert shapes[0] == shapes[2]


def test_score_is_maxsim_of_the_reference_vectors(served):
    rt, model, path, kind = served
    query = QUERIES[0]
    docs = [{"images": [png(img)], "id": f"page-{i}"} for i, img in enumerate(IMAGES)]
    result = rt.call("score", model, {"text": query}, docs)
    q = reference(path, kind, {"text": query})
    want = {
        f"page-{i}": float((q @ reference(path, kind, {"image": img}).T).max(axis=1).sum())
        for i, img in enumerate(IMAGES)
    }
    got = {e["item_id"]: e["score"] for e in result.items}
    assert got == pytest.approx(want, rel=1e-4)
    assert [e["item_id"] for e in result.items] == sorted(want, key=lambda k: -want[k])


def test_corrupt_image_fails_only_its_request(served):
    rt, model, _, _ = served
    mv = {"output_types": ["multivector"]}
    rt.call("encode", model, [{"text": "warm"}], mv)  # loaded
    corrupt = [{"text": "fine"}, {"images": [{"data": b"\x89PNG\r\n\x1a\nnot really", "format": "png"}]}]
    good = [{"images": [png(IMAGES[0])]}, {"text": "fine"}]

    async def both():  # through the BatchFormer, so that the two could share a forward pass
        return await asyncio.gather(
            rt.runtime.encode(*runtime_args("encode", model, corrupt, mv)),
            rt.runtime.encode(*runtime_args("encode", model, good, mv)),
            return_exceptions=True,
        )

    bad, ok = asyncio.run_coroutine_threadsafe(both(), rt.loop).result(timeout=120)
    assert isinstance(bad, SIEError) and bad.code == ErrorCode.INVALID_INPUT
    assert "Item 1" in bad.message
    assert not isinstance(ok, BaseException), ok
    assert [vectors(i).shape[1] for i in ok.items] == [DIM, DIM]


def test_a_padded_batch_equals_its_items_alone(served):
    """Queries of different lengths (and ColQwen2 pages of different sizes) in one forward pass:
    right padding leaves each item's vectors as they are alone (left padding would shift
    PaliGemma's positions)."""
    _, _, path, _ = served
    a = loaded_adapter(ColPaliAdapter, path, max_len=64)
    ctx = RequestContext(op="encode", output_types=("multivector",))
    units = a.prepare(
        ctx, inputs([{"text": QUERIES[0]}, {"text": QUERIES[1]}, *({"images": [png(i)]} for i in IMAGES)])
    )
    together = a.forward(ctx, units)
    for unit, out in zip(units, together, strict=True):
        np.testing.assert_allclose(out["multivector"], a.forward(ctx, [unit])[0]["multivector"], atol=1e-5)
    long_query = [{"text": "a question far longer than the window " * 4}]
    cut = a.prepare(ctx, inputs(long_query))[0]
    assert cut.truncated and cut.input_tokens == 64
    with pytest.raises(SIEError) as err:
        a.prepare(RequestContext(op="encode", truncate=False), inputs(long_query))
    assert err.value.code == ErrorCode.INPUT_TOO_LONG
