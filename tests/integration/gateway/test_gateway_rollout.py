"""``GET /v1/configs/models/{id}/status`` and the per-profile state of ``/v1/models`` on the gateway,
from real heartbeats on a real nats-server (fake workers publish them)."""

from __future__ import annotations

from protocol.catalog import Catalog
from tests.integration.gateway.conftest import DENSE
from tests.integration.gateway.fake_worker import FakeWorker
from tests.integration.gateway.test_gateway_flow import wait_workers
from tests.support.polling import wait_until


async def test_rollout_status_and_per_profile_state(nats_server, start_gateway, catalog_dirs):
    catalog = Catalog.from_dirs(*catalog_dirs)
    h_default = catalog.bundle_hash("default", pool="default")
    h_gpu = catalog.bundle_hash("default", pool="gpu")
    query = f"{DENSE}:query"
    h = await start_gateway()
    workers = [
        FakeWorker(nats_server.url, "up-to-date", consume=False, loaded=(DENSE,), heartbeat_extra={
            "bundle_config_hash": h_default,
            "model_states": {DENSE: "loaded", query: "failed"},
            "failed_models": {query: "weights are corrupt"},
        }),
        FakeWorker(nats_server.url, "behind", consume=False, heartbeat_extra={"bundle_config_hash": "old"}),
        FakeWorker(nats_server.url, "gpu-0", pool="gpu", consume=False, heartbeat_extra={
            "bundle_config_hash": h_gpu, "model_states": {DENSE: "loading"},
        }),
    ]  # fmt: skip
    for w in workers:
        await w.start()
    try:
        await wait_workers(h, 3)
        async with h.session.get(h.url(f"/v1/configs/models/{DENSE}/status")) as resp:
            assert resp.status == 200
            body = await resp.json()
        assert body["model_id"] == DENSE and body["source"] == "gateway" and body["no_bundles"] is False
        pools = {p["pool"]: p for p in body["pools"]}
        assert pools["default"] == {
            "pool": "default", "bundle_id": "default", "expected_bundle_config_hash": h_default,
            "workers": 2, "acked_workers": 1, "pending_workers": 1, "loaded_workers": 1,
            "loading_workers": 0, "failed_workers": 1, "last_error": f"{query}: weights are corrupt",
        }  # fmt: skip
        assert pools["gpu"]["acked_workers"] == 1 and pools["gpu"]["loading_workers"] == 1
        (bundle,) = body["bundles"]
        assert bundle["total_eligible_workers"] == 3 and bundle["pending_workers"] == 1
        assert bundle["acked"] is False and body["all_bundles_acked"] is False
        assert body["loaded"] is True and "weights are corrupt" in body["last_error"]

        async with h.session.get(h.url("/v1/models")) as resp:
            models = {m["name"]: m for m in (await resp.json())["models"]}
        assert models[DENSE]["loaded"] is True and models[DENSE]["state"] == "loaded"
        assert models[DENSE]["worker_count"] == 1 and models[DENSE]["last_error"] is None
        assert models[query]["loaded"] is False and models[query]["state"] == "failed"
        assert models[query]["last_error"] == {"code": "MODEL_LOAD_FAILED", "message": "weights are corrupt"}
        async with h.session.get(h.url(f"/v1/models/{query}")) as resp:
            one = await resp.json()
        assert one["state"] == "failed" and one["loaded"] is False

        # the lagging worker catches up: the rollout converges
        await workers[1].stop()
        await wait_workers_exactly(h, 2)
        async with h.session.get(h.url(f"/v1/configs/models/{DENSE}/status")) as resp:
            body = await resp.json()
        assert body["all_bundles_acked"] is True and body["bundles"][0]["pending_workers"] == 0

        async with h.session.get(h.url("/v1/configs/models/no/such/status")) as resp:
            assert resp.status == 404 and (await resp.json())["detail"]["error"] == "model_not_found"
    finally:
        for w in workers:
            await w.stop()


async def wait_workers_exactly(h, n: int) -> None:
    await wait_until(lambda: len(h.gateway.workers.healthy()) == n, what=f"exactly {n} healthy workers")
