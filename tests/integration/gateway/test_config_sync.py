"""The gateway's registry mirrored from a real config service (SQLite) over a real nats-server:
bootstrap without blocking start-up, deltas, epoch poll catch-up, remote <
local reset, the read-only config mirror and its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from config_service.main import serve as serve_config
from config_service.settings import ConfigServiceSettings
from gateway.app import create_app
from gateway.config_sync import ConfigServiceRegistry
from gateway.settings import GatewaySettings
from protocol.config_delta import ConfigDelta, encode_config_delta
from protocol.model_config import parse_model_yaml
from protocol.subjects import CONFIG_ALL
from tests.support.nats_server import free_port
from tests.support.polling import wait_until

ADMIN = "admin-secret"
GATEWAY_ADMIN = "gateway-pool-admin"  # the gateway's own admin token (pools), not the config service's
READ = "read-secret"

BUNDLE = "name: default\npriority: 10\nadapters:\n  - worker.adapters.dense\n"
BASELINE = """\
sie_id: baseline/minilm
tasks:
  encode:
    dense: {dim: 384}
profiles:
  default:
    adapter_path: worker.adapters.dense:DenseAdapter
    max_batch_tokens: 8192
"""


def model_yaml(model_id: str) -> str:
    return BASELINE.replace("baseline/minilm", model_id)


class ConfigService:
    def __init__(self, settings: ConfigServiceSettings) -> None:
        self.settings = settings
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.config_port}"

    async def start(self) -> ConfigService:
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(serve_config(self.settings, self.stop))
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient(timeout=2) as c:
            while time.monotonic() < deadline:
                if self.task.done():
                    self.task.result()
                with contextlib.suppress(httpx.TransportError):
                    r = await c.get(self.url + "/readyz")
                    if r.status_code == 200 and r.json().get("writer") and r.json().get("nats_connected"):
                        return self
                await asyncio.sleep(0.1)
        raise AssertionError("config service not ready")

    async def close(self) -> None:
        if self.task is not None:
            self.stop.set()
            await asyncio.wait_for(self.task, 15)
            self.task = None

    async def post_model(self, text: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            return await c.post(self.url + "/v1/configs/models", content=text)


class TcpProxy:
    """A TCP relay the test can cut, to disconnect one NATS client from a running server."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.server: asyncio.base_events.Server | None = None
        self.conns: list[asyncio.StreamWriter] = []

    async def start(self) -> TcpProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.conns += [writer, up_w]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            with contextlib.suppress(Exception):
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    async def cut(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        for w in self.conns:
            with contextlib.suppress(Exception):
                w.transport.abort()
        self.conns.clear()

    async def restore(self) -> None:
        await self.start()


@pytest.fixture
def config_dirs(tmp_path: Path) -> tuple[Path, Path]:
    bundles, models = tmp_path / "cfg-bundles", tmp_path / "cfg-models"
    bundles.mkdir()
    models.mkdir()
    (bundles / "default.yaml").write_text(BUNDLE)
    (models / "minilm.yaml").write_text(BASELINE)
    return bundles, models


@pytest.fixture
def config_settings(nats_server, tmp_path: Path, config_dirs) -> ConfigServiceSettings:
    return ConfigServiceSettings(
        config_db_url=f"sqlite:///{tmp_path / 'config.db'}",
        config_host="127.0.0.1",
        config_port=free_port(),
        nats_url=nats_server.url,
        nats_connect_timeout_s=5,
        admin_token=ADMIN,
        config_read_token=READ,
        bundles_dir=config_dirs[0],
        models_dir=config_dirs[1],
        pod_name="sie-config-0",
        config_lock_poll_s=0.2,
    )


@pytest_asyncio.fixture
async def config_service(config_settings):
    started: list[ConfigService] = []

    async def start() -> ConfigService:
        svc = ConfigService(config_settings)
        started.append(svc)
        return await svc.start()

    yield start
    for svc in started:
        with contextlib.suppress(Exception):
            await svc.close()


class Gw:
    def __init__(self, server: TestServer, session: ClientSession, nc, registry: ConfigServiceRegistry):
        self.server, self.session, self.nc, self.registry = server, session, nc, registry

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def get(self, path: str):
        async with self.session.get(self.url(path)) as r:
            ctype = r.headers.get("Content-Type", "")
            body = await r.json() if "json" in ctype else await r.text()
            return r.status, body

    async def model_names(self) -> list[str]:
        status, body = await self.get("/v1/models")
        assert status == 200
        return [m["name"] for m in body["models"]]

    async def metric(self, line_prefix: str) -> float:
        _, text = await self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest_asyncio.fixture
async def start_gateway(nats_server, config_settings, tmp_path):
    handles: list[Gw] = []

    async def start(
        *, nats_url: str | None = None, poll_s: float = 60.0, config_urls: str | None = None
    ) -> Gw:
        settings = GatewaySettings(
            nats_url=nats_url or nats_server.url,
            config_service_url=config_urls or f"http://127.0.0.1:{config_settings.config_port}",
            config_service_token=READ,
            admin_token=GATEWAY_ADMIN,
            config_poll_interval_s=poll_s,
            gateway_configured_gpus=["cpu"],
            stream_storage="memory",
            gateway_worker_warmup_s=0,
        )
        nc = await nats.connect(settings.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        registry = ConfigServiceRegistry(
            settings.config_service_url,
            token=settings.config_service_token,
            poll_interval_s=poll_s,
            backoff_initial_s=0.2,
            backoff_max_s=0.5,
        )
        app = create_app(settings, nc, registry)
        server = TestServer(app, handler_cancellation=True)
        await server.start_server()
        h = Gw(server, ClientSession(), nc, registry)
        handles.append(h)
        return h

    yield start
    for h in handles:
        await h.session.close()
        await h.server.close()
        with contextlib.suppress(Exception):
            await h.nc.close()


async def test_readyz_503_until_first_export_then_200(start_gateway, config_service):
    gw = await start_gateway()  # the config service is not running: start-up must not block
    status, body = await gw.get("/readyz")
    assert status == 503 and body["reason"] == "config bootstrap pending"
    assert await gw.get("/healthz") == (200, {"status": "ok"})
    assert await gw.model_names() == []
    async with gw.session.post(gw.url("/v1/encode/baseline/minilm"), json={"items": [{"text": "x"}]}) as r:
        assert (
            r.status == 503
            and r.headers["X-SIE-Error-Code"] == "QUEUE_UNAVAILABLE"
            and "Retry-After" in r.headers
        )
    await wait_until(
        lambda: _at_least(gw, "sie_gateway_config_bootstrap_failures_total", 2), what="retried bootstraps"
    )

    await config_service()

    async def ready():
        return (await gw.get("/readyz"))[0] == 200

    await wait_until(ready, what="readyz 200 after the first export")
    assert await gw.model_names() == ["baseline/minilm"]
    assert (await gw.get("/v1/configs/epoch"))[1]["epoch"] == 0


async def test_a_replica_that_cannot_be_reached_is_passed_over(
    start_gateway, config_service, config_settings
):
    await config_service()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused, as a killed replica's port
    live = f"http://127.0.0.1:{config_settings.config_port}"
    gw = await start_gateway(config_urls=f"{dead}, {live}")

    async def ready():
        return (await gw.get("/readyz"))[0] == 200

    await wait_until(ready, what="readyz 200 from the second replica")
    assert await gw.model_names() == ["baseline/minilm"]
    assert gw.registry.client.replicas.url == live  # reads stay on the replica that answered
    await gw.registry.poll_once()  # the epoch poll reads there too, without a failed try first
    assert gw.registry.client.replicas.url == live


async def test_post_to_config_service_reaches_gateway_by_delta(start_gateway, config_service):
    cfg = await config_service()
    gw = await start_gateway(poll_s=600)  # the poll cannot help: only the delta can
    await wait_until(lambda: _ready(gw), what="bootstrap")

    r = await cfg.post_model(model_yaml("acme/new-dense"))
    assert r.status_code == 201, r.text

    async def listed():
        return "acme/new-dense" in await gw.model_names()

    await wait_until(listed, what="the delta")
    assert gw.registry.exports == 1  # no re-export: the delta did it
    assert gw.registry.epoch == 1
    assert await gw.metric('sie_gateway_config_deltas_total{kind="model",result="applied"}') == 1
    assert await gw.metric("sie_gateway_config_epoch") == 1

    # the read-side mirror
    status, body = await gw.get("/v1/configs/models")
    assert status == 200
    assert {m["model_id"] for m in body["models"]} == {"baseline/minilm", "acme/new-dense"}
    status, text = await gw.get("/v1/configs/models/acme/new-dense")
    assert status == 200 and "sie_id: acme/new-dense" in text
    status, body = await gw.get("/v1/configs/models/no/such")
    assert status == 404 and body["detail"]["error"] == "model_not_found"
    status, body = await gw.get("/v1/configs/bundles")
    assert [b["bundle_id"] for b in body["bundles"]] == ["default"]
    status, body = await gw.get("/v1/configs/bundles/default?format=json")
    assert body["adapters"] == ["worker.adapters.dense"]
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {READ}"}) as c:
        remote = (await c.get(cfg.url + "/v1/configs/epoch")).json()
    status, body = await gw.get("/v1/configs/epoch")
    assert body["epoch"] == remote["epoch"] == 1 and body["bundles_hash"] == remote["bundles_hash"]
    # writes are refused: admin routes need the gateway's admin token even with auth off, and with
    # it the read-only mirror answers 405
    for method, path in (("POST", "/v1/configs/models"), ("PUT", "/v1/configs/models/acme/new-dense"),
                         ("DELETE", "/v1/configs/models/acme/new-dense")):  # fmt: skip
        async with gw.session.request(method, gw.url(path), data=model_yaml("x/y")) as resp:
            assert resp.status == 401, (method, path)
            assert (await resp.json())["detail"]["code"] == "UNAUTHORIZED"
        admin = {"Authorization": f"Bearer {GATEWAY_ADMIN}"}
        async with gw.session.request(method, gw.url(path), data=model_yaml("x/y"), headers=admin) as resp:
            assert resp.status == 405, (method, path)
            assert (await resp.json())["detail"]["error"] == "method_not_allowed"
    # the new model resolves for inference (no worker: provisioning, not 404)
    async with gw.session.post(
        gw.url("/v1/encode/acme/new-dense"),
        json={"items": [{"text": "x"}]},
        headers={"X-SIE-SDK-Version": "0.10.1"},
    ) as resp:
        assert resp.status == 503 and resp.headers["X-SIE-Error-Code"] == "PROVISIONING"


async def _ready(gw: Gw) -> bool:
    return (await gw.get("/readyz"))[0] == 200


async def test_gateway_cut_from_nats_catches_up_through_epoch_poll(
    nats_server, start_gateway, config_service
):
    cfg = await config_service()
    proxy = await TcpProxy(nats_server.port).start()
    gw = await start_gateway(nats_url=f"nats://127.0.0.1:{proxy.port}", poll_s=0.5)
    await wait_until(lambda: _ready(gw), what="bootstrap")
    await proxy.cut()

    async def disconnected():
        return not gw.nc.is_connected

    await wait_until(disconnected, what="the gateway to lose NATS")
    r = await cfg.post_model(model_yaml("acme/while-cut"))
    assert r.status_code == 201, r.text

    async def listed():
        return "acme/while-cut" in await gw.model_names()

    await wait_until(listed, what="the epoch poll to re-export")
    assert not gw.nc.is_connected  # it was the poll, not a delta
    assert gw.registry.epoch == 1 and gw.registry.exports >= 2
    await proxy.restore()
    await proxy.cut()  # leave no relay behind


async def test_a_delta_ahead_of_the_service_is_reset_by_poll(nats_server, start_gateway, config_service):
    await config_service()
    gw = await start_gateway(poll_s=600)
    await wait_until(lambda: _ready(gw), what="bootstrap")
    nc = await nats.connect(nats_server.url)
    try:

        def delta(router_id: str, model_id: str, epoch: int) -> bytes:
            return encode_config_delta(
                ConfigDelta(router_id=router_id, bundle_id="default", epoch=epoch, model_id=model_id,
                            model_config=model_yaml(model_id), affected_bundles=["default"])
            )  # fmt: skip

        # who may publish a delta is NATS's to say (only the config service's user: see
        # tests/helm/test_chart_security.py); a delta ahead of the service (a service that lost its
        # state): applied, then the poll sees remote < local and resets to the export
        await nc.publish(CONFIG_ALL, delta("sie-config-7f9c", "ghost/model", 1))
        await nc.flush()

        async def ghost():
            return "ghost/model" in await gw.model_names()

        await wait_until(ghost, what="the delta")
        assert gw.registry.epoch == 1
        assert await gw.registry.poll_once() is True
        assert gw.registry.epoch == 0
        assert "ghost/model" not in await gw.model_names()
        assert await gw.registry.poll_once() is False  # in step now
        malformed = json.dumps({"router_id": "sie-config", "epoch": -1}).encode()
        await nc.publish(CONFIG_ALL, malformed)
        await nc.flush()

        async def invalid():
            return await gw.metric('sie_gateway_config_deltas_total{kind="unknown",result="invalid"}') == 1

        await wait_until(invalid, what="the malformed delta to be counted")
    finally:
        await nc.close()


async def test_replace_and_delete_reach_the_gateway_and_a_restarted_gateway_agrees(
    start_gateway, config_service
):
    cfg = await config_service()
    gw = await start_gateway(poll_s=600)  # deltas only
    await wait_until(lambda: _ready(gw), what="bootstrap")
    assert (await cfg.post_model(model_yaml("acme/doomed"))).status_code == 201
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def mirrored_batch_tokens() -> int | None:
        status, text = await gw.get("/v1/configs/models/acme/doomed")
        return parse_model_yaml(text).profiles["default"].max_batch_tokens if status == 200 else None

    async with httpx.AsyncClient(timeout=10, headers=admin) as c:
        await wait_until(lambda: _has(gw, "acme/doomed"), what="the add")
        r = await c.put(cfg.url + "/v1/configs/models/acme/doomed",
                        content=model_yaml("acme/doomed").replace("8192", "1024"))  # fmt: skip
        assert r.status_code == 200 and r.json()["replaced"] is True

        async def replaced():
            return await mirrored_batch_tokens() == 1024

        await wait_until(replaced, what="the replace")
        r = await c.delete(cfg.url + "/v1/configs/models/acme/doomed")
        assert r.status_code == 200 and r.json()["deleted"] is True

    async def gone():
        return not await _has(gw, "acme/doomed")

    await wait_until(gone, what="the tombstone")
    assert gw.registry.exports == 1 and gw.registry.epoch == 3  # deltas did it all, no re-export
    assert await gw.metric('sie_gateway_config_deltas_total{kind="tombstone",result="applied"}') == 1
    async with gw.session.post(gw.url("/v1/encode/acme/doomed"), json={"items": [{"text": "x"}]}) as resp:
        assert resp.status == 404 and resp.headers["X-SIE-Error-Code"] == "MODEL_NOT_FOUND"
    assert (await gw.get("/v1/configs/models/acme/doomed"))[0] == 404

    # a gateway started afterwards bootstraps from the export: the model stays deleted
    gw2 = await start_gateway(poll_s=600)
    await wait_until(lambda: _ready(gw2), what="bootstrap of the second gateway")
    assert gw2.registry.epoch == 3 and not await _has(gw2, "acme/doomed")
    async with gw2.session.post(gw2.url("/v1/encode/acme/doomed"), json={"items": [{"text": "x"}]}) as resp:
        assert resp.status == 404 and resp.headers["X-SIE-Error-Code"] == "MODEL_NOT_FOUND"


async def _has(gw: Gw, model_id: str) -> bool:
    return model_id in await gw.model_names()


async def _at_least(gw, metric: str, n: float) -> bool:
    return await gw.metric(metric) >= n
