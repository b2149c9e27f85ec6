"""Reconciliation against a real config service (SQLite, in-process, no NATS publishing: only the
start-up export and the epoch poll can carry changes), and the worker's side of config changes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from protocol import ipc
from protocol.catalog import Catalog
from protocol.model_config import parse_model_yaml
from sidecar.ipc_client import IpcClient
from tests.integration.config_service.conftest import (
    ADMIN,
    BASELINE_MODEL,
    BUNDLE_DEFAULT,
    Instance,
    make_settings,
)
from tests.integration.sidecar.support import (
    InProcessWorker,
    connect,
    model_yaml,
    sidecar_settings,
    socket_path,
    start_lane,
    stop_lane,
)
from tests.support.nats_server import free_port
from tests.support.polling import wait_until
from worker.ipc.server import serve_ipc
from worker.runtime import Runtime
from worker.settings import WorkerSettings

DENSE = """\
sie_id: {sie_id}
hf_id: acme/never-downloaded
{pool}tasks:
  encode:
    dense: {{dim: 384}}
profiles:
  default:
    adapter_path: worker.adapters.dense:DenseAdapter
    max_batch_tokens: 4096
"""


def dense(sie_id: str, pool: str | None = None) -> str:
    return DENSE.format(sie_id=sie_id, pool=f"pool: {pool}\n" if pool else "")


async def test_startup_export_and_epoch_poll_reach_the_worker(nats_server, tmp_path: Path):
    bundles, models = tmp_path / "bundles", tmp_path / "models"
    bundles.mkdir()
    models.mkdir()
    (bundles / "default.yaml").write_text(BUNDLE_DEFAULT)
    (models / "minilm.yaml").write_text(BASELINE_MODEL)
    cfg = await Instance(
        make_settings(f"sqlite:///{tmp_path / 'config.db'}", None, (bundles, models))
    ).start()
    sock = socket_path()
    lane = nc = client = None
    try:
        async with cfg.client() as c:
            # before the sidecar starts: one model of pool default, one of another pool
            for body in (dense("acme/early"), dense("acme/team-model", pool="team-a")):
                r = await c.post("/v1/configs/models", content=body)
                assert r.status_code == 201, r.text
        worker = InProcessWorker(sock, BASELINE_MODEL)
        worker.runtime.catalog.put_bundle(parse_model_bundle())
        async with worker:
            # the first of the replicas listed cannot be reached (a killed one): reads pass it over
            replicas = f"http://127.0.0.1:{free_port()},{cfg.url}"
            settings = sidecar_settings(
                nats_server.url, sock, config_service_url=replicas, config_service_token=ADMIN,
                worker_config_poll_interval_ms=200, worker_config_full_export_interval_ms=600000,
            )  # fmt: skip
            lane, nc, client = await start_lane(settings)
            applier = lane.config
            await wait_until(lambda: applier.stats.get("reconciled", 0) >= 1, 20)
            assert applier.replicas is not None and applier.replicas.url == cfg.url.rstrip("/")
            async with cfg.client() as c:
                export = (await c.get("/v1/configs/export")).json()
            scoped = export["bundle_pool_config_hashes"]["default"]["default"]
            # the pool-scoped hash is the one compared (the team-a model does not count here)
            assert scoped != export["bundle_config_hashes"]["default"]
            assert applier.verified_hash == scoped == lane.heartbeat().bundle_config_hash
            assert applier.epoch == export["epoch"] == 2
            assert "acme/early" in worker.runtime.catalog

            # a write with no delta published: the epoch poll finds it
            async with cfg.client() as c:
                r = await c.post("/v1/configs/models", content=dense("acme/late"))
                assert r.status_code == 201, r.text
                assert r.json()["warnings"] == []
            await wait_until(lambda: applier.epoch == 3, 10)
            assert "acme/late" in worker.runtime.catalog
            async with cfg.client() as c:
                export = (await c.get("/v1/configs/export")).json()
            assert applier.verified_hash == export["bundle_pool_config_hashes"]["default"]["default"]

            # a delete with no delta published: the export no longer has the model, the worker drops it
            async with cfg.client() as c:
                r = await c.delete("/v1/configs/models/acme/late")
                assert r.status_code == 200 and r.json()["deleted"] is True
            await wait_until(lambda: applier.epoch == 4, 10)
            assert "acme/late" not in worker.runtime.catalog and "acme/early" in worker.runtime.catalog
            async with cfg.client() as c:
                export = (await c.get("/v1/configs/export")).json()
            assert applier.verified_hash == export["bundle_pool_config_hashes"]["default"]["default"]
    finally:
        if lane is not None:
            await stop_lane(lane, nc, client)
        await cfg.close()


def parse_model_bundle():
    from protocol.model_config import parse_bundle_yaml

    return parse_bundle_yaml(BUNDLE_DEFAULT)


async def test_changed_profile_unloads_stale_model_and_unsupported_adapters():
    sock = socket_path()
    before = model_yaml("test/m", memory_bytes=1_000_001)
    runtime = Runtime(
        WorkerSettings(device="cpu", cpu_workers=1), catalog=Catalog([parse_model_yaml(before)])
    )
    await runtime.start()
    server = await serve_ipc(runtime, sock, worker_id="w")
    client = IpcClient(sock)
    try:

        async def ready() -> str:
            return (await client.call(ipc.ENSURE_MODEL_READY, {"model_id": "test/m"}))["state"]

        for _ in range(100):
            if await ready() == ipc.STATE_READY:
                break
            await asyncio.sleep(0.05)
        assert runtime.loaded_models() == ["test/m"]
        loaded_before = runtime.loaded()[0]

        # the same config again: nothing unloaded
        await client.call(ipc.APPLY_MODEL_CONFIG, {"model_id": "test/m", "model_config": before, "epoch": 1})
        assert runtime.loaded()[0] is loaded_before

        # new load-time options for the profile: the old load is dropped, the next use loads anew
        after = model_yaml("test/m", memory_bytes=1_000_002)
        resp = await client.call(
            ipc.APPLY_MODEL_CONFIG,
            {"model_id": "test/m", "model_config": after, "epoch": 2,
             "bundle_adapters": ["worker.adapters.fake", "worker.adapters.not_in_this_image"]},
        )  # fmt: skip
        assert resp["applied"] is True
        assert loaded_before.closed and runtime.loaded_models() == []
        assert await ready() in (ipc.STATE_LOADING_STARTED, ipc.STATE_READY)
        await wait_until(lambda: runtime.loaded_models() == ["test/m"], 10)
        assert runtime.loaded()[0].resolved.loadtime_options == {"memory_bytes": 1_000_002}

        # an adapter module this image lacks: accepted into the catalog, reported unsupported
        ghost = model_yaml("test/ghost").replace("worker.adapters.fake:FakeAdapter",
                                                 "worker.adapters.not_in_this_image:Ghost")  # fmt: skip
        resp = await client.call(ipc.APPLY_MODEL_CONFIG, {"model_id": "test/ghost", "model_config": ghost})
        assert resp["unsupported_models"] == ["test/ghost"]
        assert resp["bundle_config_hash"] == runtime.bundle_config_hash() != ""

        # an export without the API model: the worker goes back to its image's models
        resp = await client.call(
            ipc.REPLACE_MODEL_CONFIGS,
            {"models": [{"model_id": "test/m", "model_config": after}],
             "bundle_adapters": ["worker.adapters.fake"]},
        )  # fmt: skip
        assert "test/ghost" not in runtime.catalog and resp["unsupported_models"] == []
        assert runtime.loaded_models() == ["test/m"]  # unchanged config: still loaded
    finally:
        await client.close()
        await server.close()
        await runtime.close()


async def test_worker_hash_matches_config_service_for_pools(tmp_path: Path):
    """The worker's hash (scoped to its pool, or unscoped) is byte-identical to the config service's."""
    bundles, models = tmp_path / "bundles", tmp_path / "models"
    bundles.mkdir()
    models.mkdir()
    (bundles / "default.yaml").write_text(BUNDLE_DEFAULT)
    (models / "minilm.yaml").write_text(BASELINE_MODEL)
    cfg = await Instance(
        make_settings(f"sqlite:///{tmp_path / 'config.db'}", None, (bundles, models))
    ).start()
    try:
        async with cfg.client() as c:
            for body in (dense("acme/a"), dense("acme/b", pool="team-a")):
                assert (await c.post("/v1/configs/models", content=body)).status_code == 201
            export = (await c.get("/v1/configs/export")).json()
        for pool in ("default", "team-a"):
            rt = Runtime(WorkerSettings(device="cpu", cpu_workers=1, pool=pool),
                         catalog=Catalog.from_dirs(models, bundles))  # fmt: skip
            try:
                await rt.replace_model_configs([parse_model_yaml(m["raw_yaml"]) for m in export["models"]])
                assert rt.bundle_config_hash() == export["bundle_pool_config_hashes"]["default"][pool]
                assert rt.bundle_config_hash(pool=None) == export["bundle_config_hashes"]["default"]
            finally:
                await rt.close()
        async with httpx.AsyncClient() as h:
            r = await h.get(cfg.url + "/v1/configs/export")  # no token: refused
            assert r.status_code == 401
    finally:
        await cfg.close()


async def test_unreachable_config_service_keeps_serving(nats_server):
    """No config service: the reconciler retries quietly and the worker's own hash is advertised."""
    sock = socket_path()
    async with InProcessWorker(sock, model_yaml("test/x")):
        settings = sidecar_settings(
            nats_server.url, sock, config_service_url="http://127.0.0.1:9", worker_config_poll_interval_ms=100
        )
        pub = await connect(nats_server.url)
        lane, nc, client = await start_lane(settings)
        try:
            await wait_until(lambda: lane.worker.last_ok is not None, 10)
            await asyncio.sleep(0.5)
            assert lane.config.verified_hash is None and lane.ready
            assert lane.heartbeat().bundle_config_hash == lane.worker.ping.bundle_config_hash
        finally:
            await stop_lane(lane, nc, client)
            await pub.close()
