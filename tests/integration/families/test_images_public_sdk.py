"""Image encode with the public sie-sdk 0.10.1 (its own media conversion: a file path and raw
bytes) through both front doors — ``sie serve`` and the cluster's gateway — on a tiny random CLIP
checkpoint, against the same computation done directly with transformers."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from transformers import CLIPImageProcessor, CLIPModel

from protocol.codec import packb
from tests.integration.cluster.test_live_model_add import LiveCluster, admin
from tests.support.cluster import running
from tests.support.image_models import CLIP_LOADTIME, model_yaml, picture, shared_image_checkpoints
from tests.support.nats_server import free_port
from tests.support.sdk312 import run_sdk, sdk_unavailable
from tests.support.serve import ServeProcess

pytestmark = pytest.mark.sdk312

SCRIPT = """
    import base64
    import numpy as np
    from sie_sdk import SIEClient
    from sie_sdk.images import to_jpeg_bytes
    with SIEClient(URL) as c:
        res = c.encode("tiny-clip", [{"images": [PATH]}, {"text": "a photo of noise"},
                                     {"images": [open(PATH, "rb").read()]}], provision_timeout_s=120)
    # a path travels as the JPEG the SDK makes of it: the reference is computed from those bytes
    sent = base64.b64encode(to_jpeg_bytes(PATH)).decode()
    print(json.dumps({"vecs": [np.asarray(r["dense"], dtype=float).tolist() for r in res], "jpeg": sent}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("images-sdk")
    ck = shared_image_checkpoints(tmp_path_factory)
    image = root / "noise.png"
    picture(7, (48, 36)).save(image)
    reason = sdk_unavailable()  # asked last: the SDK's venv is built meanwhile (tests/conftest.py)
    if reason:
        pytest.skip(reason)
    return {**ck, "image": image}


def reference(ck: dict, as_sent: Image.Image) -> np.ndarray:
    """The three items (the path as the JPEG sent, the text, the PNG bytes) done with transformers."""
    model = CLIPModel.from_pretrained(str(ck["clip"])).eval()
    proc = CLIPImageProcessor.from_pretrained(str(ck["clip"]))
    enc = ck["tok"](["a photo of noise"], padding=True, return_tensors="pt")
    with torch.no_grad():
        pixels = proc(images=[as_sent, Image.open(ck["image"])], return_tensors="pt")["pixel_values"]
        img = model.get_image_features(pixel_values=pixels)
        txt = model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    img = img if isinstance(img, torch.Tensor) else img.pooler_output
    txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    return torch.nn.functional.normalize(torch.stack([img[0], txt[0], img[1]]), dim=-1).numpy()


def encode_with_public_sdk(url: str, ck: dict) -> tuple[np.ndarray, np.ndarray]:
    """(vectors answered, vectors transformers computes for what was sent)."""
    out = run_sdk(SCRIPT.replace("PATH", repr(str(ck["image"]))), url)
    sent = Image.open(io.BytesIO(base64.b64decode(out["jpeg"])))
    return np.asarray(out["vecs"], dtype=np.float32), reference(ck, sent)


def test_image_encode_through_sie_serve(tiny):
    with ServeProcess(env={"SIE_MODELS_DIR": str(tiny["models"]), "SIE_PRELOAD_MODELS": "tiny-clip"}) as srv:
        vecs, ref = encode_with_public_sdk(srv.url, tiny)
    assert vecs.shape == (3, 16)
    np.testing.assert_allclose(vecs, ref, atol=1e-5)


def test_image_encode_through_the_gateway(tiny, tmp_path):
    cluster = LiveCluster(state_dir=tmp_path / "state", gateway_port=free_port(), config_port=free_port(),
                          nats_port=free_port())  # fmt: skip
    with running(cluster) as c:
        body = model_yaml("tiny-clip", tiny["clip"], 64, CLIP_LOADTIME)
        r = httpx.post(c.config_url + "/v1/configs/models", content=body, headers=admin(), timeout=30)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the model reaches the gateway by a NATS delta
            probe = httpx.post(
                c.gateway_url + "/v1/encode/tiny-clip", json={"items": [{"text": "x"}]}, timeout=60
            )
            if probe.status_code == 200:
                break
            time.sleep(0.5)
        assert probe.status_code == 200, probe.text
        vecs, ref = encode_with_public_sdk(c.gateway_url, tiny)
        # a 5 MB image: over a queue message (1 MiB), it goes through the payload store (issue 34)
        # 1000 x 1000 pixels (the fixture's pixel limit) of noise, and a camera's worth of metadata
        meta = PngInfo()
        meta.add_text("Comment", "noise " * 400_000)
        buf = io.BytesIO()
        picture(11, (1000, 1000)).save(buf, format="PNG", pnginfo=meta)
        big = buf.getvalue()
        assert len(big) > 5_000_000
        r = httpx.post(
            c.gateway_url + "/v1/encode/tiny-clip",
            content=packb({"items": [{"images": [{"data": big, "format": "png"}]}]}),
            headers={"Content-Type": "application/msgpack", "Accept": "application/json"},
            timeout=120,
        )
        assert r.status_code == 200, r.text[:300]
        got = np.asarray(r.json()["items"][0]["dense"]["values"], dtype=np.float32)
    assert vecs.shape == (3, 16)
    np.testing.assert_allclose(vecs, ref, atol=1e-5)
    model = CLIPModel.from_pretrained(str(tiny["clip"])).eval()
    proc = CLIPImageProcessor.from_pretrained(str(tiny["clip"]))
    with torch.no_grad():
        feats = model.get_image_features(
            pixel_values=proc(images=[Image.open(io.BytesIO(big))], return_tensors="pt")["pixel_values"]
        )
    feats = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
    np.testing.assert_allclose(got, torch.nn.functional.normalize(feats, dim=-1)[0].numpy(), atol=1e-5)
