"""``sie serve --api-key`` (SIE_API_KEY): bearer keys on every route but the probes and the API docs,
over real HTTP, in process and as the ``sie serve`` command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from deploy.cli import build_parser
from tests.support.nats_server import free_port
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

F = "sie-fake"
REPO = Path(__file__).resolve().parents[3]
ENCODE = {"items": [{"text": "hello"}]}


def _settings(**over) -> WorkerSettings:
    return WorkerSettings(
        **{"preload_models": F, "machine_profile": "cpu", "api_key": "k-one, k-two", **over}
    )


@pytest.fixture
async def client():
    settings = _settings()
    async with TestClient(TestServer(create_app(Runtime(settings), settings))) as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Accept": "application/json"}


async def test_encode_needs_one_of_the_keys(client):
    r = await client.post(f"/v1/encode/{F}", json=ENCODE)
    assert r.status == 401
    body = await r.json()
    assert body["detail"]["code"] == "UNAUTHORIZED" and "Missing bearer token" in body["detail"]["message"]
    assert r.headers["X-SIE-Error-Code"] == "UNAUTHORIZED"
    r = await client.post(f"/v1/encode/{F}", json=ENCODE, headers=bearer("k-three"))
    assert r.status == 401 and (await r.json())["detail"]["code"] == "UNAUTHORIZED"
    assert "k-one" not in await r.text()  # a refusal names no key
    for key in ("k-one", "k-two"):  # each of the comma-separated keys, spaces trimmed
        r = await client.post(f"/v1/encode/{F}", json=ENCODE, headers=bearer(key))
        assert r.status == 200, await r.text()
        assert len((await r.json())["items"]) == 1
    r = await client.post(f"/v1/encode/{F}", json=ENCODE, headers={"Authorization": "k-one"})
    assert r.status == 200  # a bare token, as the gateway takes it


async def test_probes_and_docs_are_open_the_rest_is_not(client):
    for path in ("/healthz", "/livez", "/readyz", "/openapi.json", "/docs", "/docs/assets/swagger-ui.css"):
        r = await client.get(path)
        assert r.status == 200, path
    doc = await (await client.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in ("/", "/health", "/metrics", "/v1/models", f"/v1/models/{F}", "/ws/status", "/no/such/route"):
        r = await client.get(path)
        assert r.status == 401, path
        assert (await r.json())["detail"]["code"] == "UNAUTHORIZED"
    for path in ("/health", "/metrics", "/v1/models"):
        assert (await client.get(path, headers=bearer("k-two"))).status == 200, path


async def test_compatible_routes_refuse_in_their_own_error_shape(client):
    r = await client.post("/v1/embeddings", json={"model": F, "input": "x"})
    assert r.status == 401
    assert (await r.json())["error"]["code"] == "UNAUTHORIZED"  # OpenAI's envelope
    r = await client.post("/rerank", json={"model": F, "query": "q", "texts": ["a"]})
    assert r.status == 401
    assert (await r.json())["error_type"] == "Validation"  # TEI's shape
    r = await client.post("/v1/embeddings", json={"model": F, "input": "x"}, headers=bearer("k-one"))
    assert r.status == 200, await r.text()


async def test_exempt_operational_opens_metrics_and_health_only():
    settings = _settings(auth_exempt_operational=True)
    async with TestClient(TestServer(create_app(Runtime(settings), settings))) as c:
        for path in ("/", "/health", "/metrics"):
            assert (await c.get(path)).status == 200, path
        assert (await c.get("/v1/models")).status == 401
        assert (await c.post(f"/v1/encode/{F}", json=ENCODE)).status == 401


async def test_no_key_no_auth():
    settings = _settings(api_key="")
    async with TestClient(TestServer(create_app(Runtime(settings), settings))) as c:
        assert (await c.post(f"/v1/encode/{F}", json=ENCODE)).status == 200
        assert (await c.get("/metrics")).status == 200


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("SIE_API_KEY", "env-a,env-b")
    settings = WorkerSettings()
    assert settings.api_keys() == ["env-a", "env-b"]
    assert "env-a" not in repr(settings)  # kept out of any settings dump in a log
    args = build_parser().parse_args(["serve", "--api-key", "flag-key"])
    assert args.api_key == "flag-key"


def test_sie_serve_help_documents_the_api_key():
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "--api-key KEY" in out.stdout and "SIE_API_KEY" in out.stdout


def test_sie_serve_with_api_key_flag_over_real_http(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = {**os.environ, "SIE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "SIE_TORCH_THREADS": "1"}
    env.pop("SIE_API_KEY", None)
    cmd = [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--preload", F, "--api-key", "cli-key-1,cli-key-2"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:  # a probe: no key
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert httpx.get(url + "/openapi.json", timeout=10).status_code == 200
        assert httpx.post(f"{url}/v1/encode/{F}", json=ENCODE, timeout=30).status_code == 401
        wrong = httpx.post(f"{url}/v1/encode/{F}", json=ENCODE, headers=bearer("nope"), timeout=30)
        assert wrong.status_code == 401 and wrong.json()["detail"]["code"] == "UNAUTHORIZED"
        for key in ("cli-key-1", "cli-key-2"):
            r = httpx.post(f"{url}/v1/encode/{F}", json=ENCODE, headers=bearer(key), timeout=30)
            assert r.status_code == 200, r.text
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "bearer keys required (2 configured" in text
    assert "cli-key-1" not in text and "cli-key-2" not in text  # the keys are never logged
