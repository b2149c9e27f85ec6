from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.app import GATEWAY_KEY, create_app
from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.registry import CatalogRegistry
from gateway.settings import GatewaySettings

DENSE = "test/dense-model"
RERANK = "test/reranker"
EXTRACT = "test/extractor"


def write_catalog(root: Path) -> tuple[str, str]:
    models = root / "models"
    bundles = root / "bundles"
    models.mkdir()
    bundles.mkdir()
    (models / "dense.yaml").write_text(
        textwrap.dedent(f"""
        sie_id: {DENSE}
        tasks:
          encode:
            dense: {{dim: 4}}
        profiles:
          default:
            adapter_path: fake_dense:Adapter
            max_batch_tokens: 1024
          query:
            extends: default
            adapter_options:
              runtime: {{is_query: true}}
    """)
    )
    (models / "rerank.yaml").write_text(
        textwrap.dedent(f"""
        sie_id: {RERANK}
        tasks:
          score: {{}}
        profiles:
          default:
            adapter_path: fake_rerank:Adapter
            max_batch_tokens: 1024
    """)
    )
    (models / "extract.yaml").write_text(
        textwrap.dedent(f"""
        sie_id: {EXTRACT}
        tasks:
          extract: {{}}
        profiles:
          default:
            adapter_path: fake_extract:Adapter
            max_batch_tokens: 1024
    """)
    )
    (bundles / "default.yaml").write_text(
        textwrap.dedent("""
        name: default
        priority: 10
        adapters: [fake_dense, fake_rerank, fake_extract]
    """)
    )
    return str(models), str(bundles)


@pytest.fixture
def catalog_dirs(tmp_path):
    return write_catalog(tmp_path)


@pytest.fixture
def make_settings(nats_server, catalog_dirs):
    def make(**overrides) -> GatewaySettings:
        base = dict(
            nats_url=nats_server.url,
            models_dir=catalog_dirs[0],
            bundles_dir=catalog_dirs[1],
            gateway_configured_gpus=["cpu", "l4"],
            gateway_request_timeout_s=8.0,
            gateway_provisioning_retry_after_s=3,
            gateway_worker_warmup_s=0,  # tests that need the warm-up set it themselves
        )
        base.update(overrides)
        return GatewaySettings(**base)

    return make


class GatewayHandle:
    def __init__(self, server: TestServer, session: ClientSession, nc) -> None:
        self.server = server
        self.session = session
        self.nc = nc

    @property
    def gateway(self):
        return self.server.app[GATEWAY_KEY]

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))


@pytest_asyncio.fixture
async def start_gateway(make_settings):
    handles: list[GatewayHandle] = []

    async def start(**overrides) -> GatewayHandle:
        settings = make_settings(**overrides)
        nc = await nats.connect(settings.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        registry = CatalogRegistry.from_dirs(settings.models_dir, settings.bundles_dir)
        app = create_app(settings, nc, registry)
        server = TestServer(app, handler_cancellation=True)
        await server.start_server()
        session = ClientSession()
        h = GatewayHandle(server, session, nc)
        handles.append(h)
        return h

    yield start
    for h in handles:
        await h.session.close()
        await h.server.close()
        with contextlib.suppress(Exception):
            await h.nc.close()


@pytest_asyncio.fixture
async def dispatcher(nats_server):
    """``await dispatcher(**kwargs)``: a gateway Dispatcher (its own metrics, memory storage unless
    ``storage`` says) on a new connection to the test's nats-server (``connect``: nats.connect's
    options), the connections closed after the test."""
    connections: list[nats.NATS] = []

    async def make(connect: dict | None = None, **kwargs) -> Dispatcher:
        nc = await nats.connect(nats_server.url, **(connect or {}))
        connections.append(nc)
        kwargs.setdefault("metrics", GatewayMetrics())
        kwargs.setdefault("storage", "memory")
        return Dispatcher(nc, **kwargs)

    yield make
    for nc in connections:
        await nc.close()
