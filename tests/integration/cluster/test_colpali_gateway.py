"""ColPali and ColQwen2 through the gateway (real cluster): the catalog entries, their weights
replaced through the config service by tiny random checkpoints of the same architectures
(tests/support/colpali_models.py); a page image and a text query are encoded as multi-vectors
and scored, and the gateway's score equals MaxSim over the vectors it returned."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

pytest.importorskip("transformers", reason="the worker runtime is not installed")

from tests.integration.cluster.conftest import ADMIN  # noqa: E402
from tests.support.colpali_models import DIM, build_colpali, build_colqwen2  # noqa: E402
from tests.support.image_models import picture, png  # noqa: E402
from tests.support.polling import wait_until  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CASES = [
    ("vidore/colpali-v1.3-hf", "colpali-v1.3-hf.yaml", build_colpali),
    ("vidore/colqwen2-v1.0-hf", "colqwen2-v1.0-hf.yaml", build_colqwen2),
]
JSON = {"Accept": "application/json", "X-SIE-MACHINE-PROFILE": "cpu"}


def _put_tiny(config_url: str, entry: str, checkpoint: Path) -> None:
    data = yaml.safe_load((REPO / "worker" / "catalog" / "models" / entry).read_text())
    data["weights_path"] = str(checkpoint)
    data["tasks"]["encode"]["multivector"]["dim"] = DIM
    data["profiles"]["default"]["compute_precision"] = "float32"
    resp = httpx.put(
        f"{config_url}/v1/configs/models/{data['sie_id']}",
        content=yaml.safe_dump(data),
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def _encode(url: str, model: str, items: list[dict]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/encode/{model}",
        json={"items": items, "params": {"output_types": ["multivector"]}},
        headers=JSON,
        timeout=60,
    )


def _vectors(item: dict) -> np.ndarray:
    mv = item["multivector"]
    return np.asarray(mv["values"], dtype=np.float32).reshape(mv["num_tokens"], mv["token_dims"])


@pytest.mark.parametrize(("model", "entry", "build"), CASES, ids=["colpali", "colqwen2"])
def test_visual_retriever_through_the_gateway(cluster, tmp_path, model, entry, build):
    checkpoint = build(tmp_path / "ckpt")
    _put_tiny(cluster.config_url, entry, checkpoint)
    page = {"id": "page", "images": [{"data": base64.b64encode(png(picture(1))).decode(), "format": "png"}]}
    query = {"id": "q", "text": "what is the total?"}

    def served() -> httpx.Response | None:
        resp = _encode(cluster.gateway_url, model, [query, page])
        if resp.status_code == 200:
            return resp
        assert resp.status_code in (404, 503), resp.text  # not synced yet / loading
        return None

    resp = asyncio.run(wait_until(served, 180, interval_s=0.5, what=f"{model} answered by the gateway"))
    q_item, page_item = resp.json()["items"]
    qv, pv = _vectors(q_item), _vectors(page_item)
    assert qv.shape[1] == pv.shape[1] == DIM and qv.shape[0] >= 1 and pv.shape[0] >= 1

    score = httpx.post(
        f"{cluster.gateway_url}/v1/score/{model}",
        json={"query": query, "items": [page]},
        headers=JSON,
        timeout=60,
    )
    assert score.status_code == 200, score.text
    (entry_,) = score.json()["scores"]
    expected = float((qv @ pv.T).max(axis=1).sum())
    assert entry_["item_id"] == "page"
    assert entry_["score"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
