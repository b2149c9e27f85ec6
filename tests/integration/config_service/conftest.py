"""Fixtures: bundle/model YAML in tmp dirs, a database per test (SQLite file, or a fresh
PostgreSQL database when 127.0.0.1:5432 answers), and config service instances run through the
real wiring (config_service.main.serve) in-process or as ``python -m config_service``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import pytest

from config_service.main import serve
from config_service.settings import ConfigServiceSettings
from tests.support import postgres
from tests.support.nats_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[3]
ADMIN = "admin-secret"
READ = "read-secret"
INFER = "infer-secret"

BUNDLE_DEFAULT = """\
name: default
priority: 10
adapters:
  - worker.adapters.dense
  - worker.adapters.sparse
"""
BUNDLE_RERANK = """\
name: rerank
priority: 20
adapters:
  - worker.adapters.dense
  - worker.adapters.cross_encoder
"""


def dense_model(sie_id: str, hf_id: str | None = None, max_batch_tokens: int = 4096) -> str:
    """A model config (YAML text) of one dense-encoding profile, named ``sie_id``."""
    return f"""\
sie_id: {sie_id}
hf_id: {hf_id or sie_id}
tasks:
  encode:
    dense: {{dim: 384}}
profiles:
  default:
    adapter_path: worker.adapters.dense:DenseAdapter
    max_batch_tokens: {max_batch_tokens}
"""


BASELINE_MODEL = dense_model("baseline/minilm", "sentence-transformers/all-MiniLM-L6-v2", 8192)


@pytest.fixture
def catalog_dirs(tmp_path: Path) -> tuple[Path, Path]:
    bundles = tmp_path / "bundles"
    models = tmp_path / "models"
    bundles.mkdir()
    models.mkdir()
    (bundles / "default.yaml").write_text(BUNDLE_DEFAULT)
    (bundles / "rerank.yaml").write_text(BUNDLE_RERANK)
    (models / "minilm.yaml").write_text(BASELINE_MODEL)
    return bundles, models


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'state' / 'config.db'}"
        return
    with postgres.databases("sie_cfg") as (url,):
        yield url


def make_settings(
    db_url: str, nats_url: str | None, dirs: tuple[Path, Path], **extra
) -> ConfigServiceSettings:
    bundles, models = dirs
    return ConfigServiceSettings(
        config_db_url=db_url,
        config_host="127.0.0.1",
        config_port=free_port(),
        nats_url=nats_url,
        nats_connect_timeout_s=5,
        admin_token=ADMIN,
        config_read_token=READ,
        auth_token=INFER,
        bundles_dir=bundles,
        models_dir=models,
        pod_name="sie-config-test",
        config_lock_poll_s=0.2,
        **extra,
    )


@dataclass
class Instance:
    settings: ConfigServiceSettings
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.config_port}"

    def client(self, token: str | None = ADMIN) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10)

    async def start(self, *, writer: bool = True, nats: bool = True) -> Instance:
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(serve(self.settings, self.stop))
        await wait_ready(self.url, writer=writer, nats=nats and bool(self.settings.nats_url), task=self.task)
        return self

    async def close(self) -> None:
        if self.task is not None:
            self.stop.set()
            await asyncio.wait_for(self.task, 15)
            self.task = None


async def wait_ready(url: str, *, writer: bool, nats: bool, task=None, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            if task is not None and task.done():
                task.result()  # raise the startup error
            try:
                r = await client.get("/readyz")
                last = r.json()
                if (
                    r.status_code == 200
                    and (not writer or last["writer"])
                    and (not nats or last["nats_connected"])
                ):
                    return last
            except httpx.TransportError as exc:
                last = repr(exc)
            await asyncio.sleep(0.1)
    raise AssertionError(f"config service at {url} not ready: {last}")


@pytest.fixture
async def instances():
    started: list[Instance] = []

    def factory(settings: ConfigServiceSettings) -> Instance:
        inst = Instance(settings)
        started.append(inst)
        return inst

    yield factory
    for inst in started:
        with contextlib.suppress(Exception):
            await inst.close()


@pytest.fixture
def service(nats_server, db_url, catalog_dirs, instances):
    """``await service(**settings)``: a config service started on this test's database, nats-server
    and catalog (``settings`` beyond make_settings' own), closed at teardown."""

    async def start(**extra) -> Instance:
        return await instances(make_settings(db_url, nats_server.url, catalog_dirs, **extra)).start()

    return start


@pytest.fixture
async def nc(nats_server):
    """A NATS client connection to this test's nats-server."""
    conn = await nats.connect(nats_server.url)
    try:
        yield conn
    finally:
        await conn.close()


@dataclass
class Proc:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def spawn(tmp_path: Path):
    """Start ``python -m config_service`` subprocesses (killed at teardown)."""
    procs: list[Proc] = []

    def start(settings: ConfigServiceSettings, name: str) -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIE_")}
        env.update(
            {
                "PYTHONPATH": str(REPO_ROOT),
                "SIE_CONFIG_DB_URL": settings.config_db_url or "",
                "SIE_CONFIG_HOST": "127.0.0.1",
                "SIE_CONFIG_PORT": str(settings.config_port),
                "SIE_NATS_URL": settings.nats_url or "",
                "SIE_NATS_CONNECT_TIMEOUT_S": "5",
                "SIE_ADMIN_TOKEN": ADMIN,
                "SIE_CONFIG_READ_TOKEN": READ,
                "SIE_AUTH_TOKEN": INFER,
                "SIE_BUNDLES_DIR": str(settings.bundles_dir),
                "SIE_MODELS_DIR": str(settings.models_dir),
                "SIE_CONFIG_LOCK_POLL_S": "0.2",
                "POD_NAME": name,
            }
        )
        log = tmp_path / f"{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "config_service"],
            cwd=str(tmp_path),
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        p = Proc(proc, settings.config_port, log)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait(10)
