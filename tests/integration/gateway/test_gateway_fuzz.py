"""Property-based fuzzing of every gateway route (issue 12): no 5xx, no hang, and a normal request
still succeeds afterwards. Real nats-server, a fake lane peer answering the test models."""

from __future__ import annotations

import httpx
import nats
import pytest
from hypothesis import given

from gateway.app import create_app
from gateway.registry import CatalogRegistry
from gateway.settings import GatewaySettings
from tests.integration.gateway.conftest import DENSE, EXTRACT, RERANK, write_catalog
from tests.integration.gateway.fake_worker import FakeWorker
from tests.support.fuzz import (
    FUZZ_SETTINGS,
    NO_HANG_S,
    OUTCOMES,
    LoopThread,
    Vocabulary,
    assert_no_5xx,
    inference_fields,
    requests_for,
    send,
    serve_app,
)

MODELS = [DENSE, RERANK, EXTRACT, f"{DENSE}:query", "default:/" + DENSE]


@pytest.fixture
def gateway(nats_server, tmp_path):
    models_dir, bundles_dir = write_catalog(tmp_path)
    settings = GatewaySettings(
        nats_url=nats_server.url,
        models_dir=models_dir,
        bundles_dir=bundles_dir,
        gateway_configured_gpus=["cpu", "l4"],
        gateway_request_timeout_s=8.0,
        gateway_worker_warmup_s=0,
        gateway_body_timeout_s=5.0,
    )
    loop = LoopThread()

    async def start():
        nc = await nats.connect(settings.nats_url)
        app = create_app(settings, nc, CatalogRegistry.from_dirs(models_dir, bundles_dir))
        runner, port = await serve_app(app)
        worker = await FakeWorker(nats_server.url, "w1").start()
        return nc, app, runner, port, worker

    nc, app, runner, port, worker = loop.run(start())
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=NO_HANG_S)
    try:
        yield app, client
    finally:
        client.close()

        async def stop():
            await worker.stop()
            await runner.cleanup()
            await nc.close()

        loop.run(stop())
        loop.close()


def normal_request_succeeds(client: httpx.Client) -> None:
    for _ in range(100):  # the fake worker's first heartbeat may still be on its way
        r = client.post(
            f"/v1/encode/{DENSE}",
            json={"items": [{"text": "normal"}]},
            headers={"Accept": "application/json"},
        )
        if r.status_code != 202 and r.headers.get("X-SIE-Error-Code") != "PROVISIONING":
            break
    assert r.status_code == 200, r.text
    assert len(r.json()["items"][0]["dense"]["values"]) == 4


def test_fuzz_every_gateway_route(gateway):
    app, client = gateway
    normal_request_succeeds(client)

    @FUZZ_SETTINGS
    @given(requests_for(app, Vocabulary(MODELS, inference_fields(MODELS))))
    def fuzz(req):
        assert_no_5xx(send(client, req), req)

    fuzz()
    print("gateway fuzz outcomes:", dict(OUTCOMES.most_common()))
    normal_request_succeeds(client)
