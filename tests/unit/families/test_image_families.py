"""Images and texts into one space (CLIP, SigLIP) on tiny random checkpoints (2-layer towers,
32×32 images, the MiniLM vocabulary), against the same computation done directly with
transformers; image items through ``sie serve`` and our SDK's media conversion; size limits
and corrupt images answered 400 without disturbing the requests beside them."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import (
    CLIPImageProcessor,
    CLIPModel,
    SiglipImageProcessor,
    SiglipModel,
)

from protocol.codec import packb, unpackb
from sdk import SIEClient
from sdk.media import sniff_format, to_wire_image
from tests.support.image_models import picture, png, shared_image_checkpoints
from tests.support.serve import ServeProcess
from tests.support.typed import inputs
from tests.unit.families.conftest import loaded_adapter
from worker.adapters.base import RequestContext
from worker.adapters.clip import CLIPAdapter


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return shared_image_checkpoints(tmp_path_factory)


def adapter(path: Path, maxlen: int, loadtime: dict) -> CLIPAdapter:
    return loaded_adapter(CLIPAdapter, path, loadtime, maxlen)


def features(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_images_and_texts_equal_transformers(checkpoints, kind):
    siglip = kind == "siglip"
    path = checkpoints[kind]
    a = adapter(
        path,
        16 if siglip else 64,
        {"text_padding": "max_length", "text_attention_mask": False} if siglip else {},
    )
    imgs = [picture(1), picture(2, (64, 64))]
    texts = ["a photo of noise", "static"]
    items = [
        {"images": [{"data": png(imgs[0]), "format": "png"}]},
        {"text": texts[0]},
        {"images": [base64.b64encode(png(imgs[1])).decode()]},
        {"text": texts[1]},
    ]
    ctx = RequestContext(op="encode")
    got = np.stack([o["dense"] for o in a.forward(ctx, a.prepare(ctx, inputs(items)))])
    model = (SiglipModel if siglip else CLIPModel).from_pretrained(str(path)).eval()
    proc = (SiglipImageProcessor if siglip else CLIPImageProcessor).from_pretrained(str(path))
    tok = checkpoints["tok"]
    with torch.no_grad():
        img = features(
            model.get_image_features(pixel_values=proc(images=imgs, return_tensors="pt")["pixel_values"])
        )
        if siglip:
            enc = tok(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
            txt = features(model.get_text_features(input_ids=enc["input_ids"]))
        else:
            enc = tok(texts, padding=True, return_tensors="pt")
            txt = features(
                model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
            )
    ref = torch.nn.functional.normalize(torch.stack([img[0], txt[0], img[1], txt[1]]), dim=-1).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_sdk_converts_media_to_the_wire_form(tmp_path):
    img = picture(3)
    assert to_wire_image(img)["format"] == "jpeg" and to_wire_image(np.asarray(img))["format"] == "jpeg"
    path = tmp_path / "x.png"
    img.save(path)
    wire = to_wire_image(str(path))
    assert wire == {"data": path.read_bytes(), "format": "png"}
    assert sniff_format(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "webp" and sniff_format(b"GIF89a..") == "gif"
    with pytest.raises(TypeError):
        to_wire_image(3.5)


def test_image_items_through_sie_serve(checkpoints):
    with (
        ServeProcess(
            env={"SIE_MODELS_DIR": str(checkpoints["models"]), "SIE_PRELOAD_MODELS": "tiny-clip"}
        ) as srv,
        SIEClient(srv.url) as client,
    ):
        img = picture(4)
        res = client.encode("tiny-clip", [{"images": [img]}, {"text": "noise"}, {"images": png(img)}])
        vecs = np.stack([r["dense"] for r in res])
        assert vecs.shape == (3, 16)
        assert abs(float(vecs[0] @ vecs[2])) > 0.99  # the same picture, as JPEG and as PNG

        def post(items):
            return httpx.post(
                f"{srv.url}/v1/encode/tiny-clip",
                content=packb({"items": items}),
                timeout=60,
                headers={"Content-Type": "application/msgpack"},
            )

        corrupt = post(
            [{"text": "fine"}, {"images": [{"data": b"\x89PNG\r\n\x1a\nnot really", "format": "png"}]}]
        )
        assert corrupt.status_code == 400 and corrupt.json()["detail"]["code"] == "INVALID_INPUT"
        assert "Item 1" in corrupt.json()["detail"]["message"]
        huge = post([{"images": [{"data": png(picture(5, (1200, 1000))), "format": "png"}]}])
        assert huge.status_code == 400 and "pixels" in huge.json()["detail"]["message"]
        bad_b64 = post([{"images": ["%%%not base64%%%"]}])
        assert bad_b64.status_code == 400
        ok = post([{"images": [{"data": png(img), "format": "png"}]}])  # the server is fine after all that
        assert ok.status_code == 200 and unpackb(ok.content)["items"][0]["dense"]["values"].shape == (16,)
