"""Helpers for the sidecar integration tests: fake models, a worker (in-process or subprocess), a
gateway-like publisher and result collector."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors

from protocol.api import Item
from protocol.catalog import Catalog
from protocol.jobs import JobItem
from protocol.model_config import parse_model_yaml
from protocol.subjects import HEALTH_PREFIX, direct_subject, reply_subject, results_subject, work_subject
from protocol.work import WorkResult
from protocol.work_codec import H_TAKEN, WorkCodec, WorkMessage
from sidecar.ipc_client import IpcClient
from sidecar.lane import LaneConsumer
from sidecar.settings import SidecarSettings
from tests.support.jobs import encode_job, encode_params
from tests.support.polling import wait_until
from worker.ipc.server import serve_ipc
from worker.runtime import Runtime
from worker.settings import WorkerSettings

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[3]

MODEL_YAML = """
sie_id: {model_id}
package_backed: true
tasks:
  encode:
    dense: {{dim: 8}}
profiles:
  default:
    adapter_path: worker.adapters.fake:FakeAdapter
    max_batch_tokens: 4096
    adapter_options:
      loadtime: {loadtime}
"""


def model_yaml(model_id: str, **loadtime) -> str:
    return MODEL_YAML.format(model_id=model_id, loadtime=json.dumps(loadtime))


def socket_path() -> str:
    return f"/tmp/sie-ipc-it-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def sidecar_settings(nats_url: str, sock: str, **overrides) -> SidecarSettings:
    values = {
        "nats_url": nats_url,
        "pool": "default",
        "machine_profile": "cpu",
        "bundle": "default",
        "worker_id": f"sidecar-{uuid.uuid4().hex[:6]}",
        "ipc_socket_path": sock,
        "nak_delay_s": 0.5,
        "oom_nak_delay_s": 0.5,
        "model_loading_recheck_s": 0.3,
        "worker_ping_interval_ms": 300,
        "health_publish_interval_ms": 300,
        "nats_fetch_timeout_s": 0.5,
        "ack_wait_s": 30.0,
        "drain_timeout_s": 5.0,
    }
    values.update(overrides)
    return SidecarSettings(**values)


class InProcessWorker:
    """A real Runtime (fake adapter) behind the real IPC server, in this event loop."""

    def __init__(self, sock: str, *yamls: str, **settings) -> None:
        self.sock = sock
        self.runtime = Runtime(
            WorkerSettings(device="cpu", cpu_workers=1, **settings),
            catalog=Catalog([parse_model_yaml(y) for y in yamls]),
        )
        self.server = None

    async def __aenter__(self) -> InProcessWorker:
        await self.runtime.start()
        self.server = await serve_ipc(self.runtime, self.sock, worker_id="worker-it")
        return self

    async def __aexit__(self, *exc) -> None:
        if self.server is not None:
            await self.server.close()
        await self.runtime.close()


class WorkerProcess:
    """``python -m worker.ipc`` with a models dir of fake models (killable mid-batch)."""

    def __init__(self, sock: str, models_dir: Path, bundles_dir: Path) -> None:
        self.sock = sock
        self.models_dir = models_dir
        self.bundles_dir = bundles_dir
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> WorkerProcess:
        env = dict(os.environ)
        env.update(
            SIE_IPC_SOCKET_PATH=self.sock,
            SIE_MODELS_DIR=str(self.models_dir),
            SIE_BUNDLES_DIR=str(self.bundles_dir),
            SIE_DEVICE="cpu",
            SIE_CPU_WORKERS="1",
            SIE_WORKER_ID="worker-proc",
            PYTHONPATH=str(REPO),
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock)
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.ipc"], cwd=REPO, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}")
            if os.path.exists(self.sock):
                return self
            time.sleep(0.05)
        raise RuntimeError("worker IPC socket did not appear")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Gateway:
    """Publishes work items the way the gateway does and collects results from its inbox."""

    def __init__(self, nc, router_id: str | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.results: dict[str, list[WorkResult]] = {}
        self.raw: list[bytes] = []
        self.messages = 0  # result messages received
        self.together = 0  # results that came in a message with others (results_subject)
        self._sub = None
        self._arrived = asyncio.Event()

    async def start(self) -> Gateway:
        self._sub = await self.nc.subscribe(f"_INBOX.{self.router_id}.>", cb=self._on_result)
        await self.nc.flush()
        return self

    async def _on_result(self, msg) -> None:
        self.raw.append(msg.data)
        self.messages += 1
        together = msg.subject == results_subject(self.router_id)
        for res in WorkCodec.results(msg.data):
            self.results.setdefault(res.work_item_id, []).append(res)
            self.together += together
        self._arrived.set()

    def item(
        self, request_id: str, index: int, *, model_id: str, text: str, total: int = 1, **extra
    ) -> JobItem:
        """Item ``index`` of an encode request; ``extra``: the job's fields, or its params'."""
        params = {
            k: extra.pop(k) for k in ("instruction", "is_query", "options", "output_dtype") if k in extra
        }
        job = encode_job(
            request_id,
            total,
            model_id=model_id,
            router_id=self.router_id,
            reply_subject=extra.pop("reply_subject", reply_subject(self.router_id, request_id)),
            bundle="default",
            params=encode_params(**params),
            **extra,
        )
        return JobItem(job, index, Item(text=text))

    @staticmethod
    def message(item: JobItem, request_items: int = 1, results: str | None = None) -> WorkMessage:
        """The work message of ``item`` alone, as the gateway makes it."""
        [msg] = WorkCodec.messages(
            [item], per_message=1, max_bytes=1 << 20, request_items=request_items, results_subject=results
        )
        return msg

    async def publish(self, item: JobItem, request_items: int = 1, *, together: bool = False) -> None:
        """Publish ``item`` as the gateway does; ``together``: with this gateway's results subject,
        so that the sidecar may send its result in one message with others."""
        subject = work_subject("default", "cpu", "default", item.job.model_id)
        # Right after a server restart JetStream may need a moment: retry like the gateway does
        # (Nats-Msg-Id, among the routing headers, makes a retried publish land once).
        for attempt in range(20):
            try:
                msg = self.message(item, request_items, results_subject(self.router_id) if together else None)
                await self.js.publish(subject, msg.payload, headers=msg.headers)
                return
            except (
                nats.errors.TimeoutError,
                nats.js.errors.ServiceUnavailableError,
                nats.errors.NoRespondersError,
            ):
                if attempt == 19:
                    raise
                await asyncio.sleep(0.5)

    async def publish_direct(self, item: JobItem, request_items: int = 1, taken: str | None = None) -> None:
        """Send ``item`` on the lane's direct path, as the gateway does while the lane's stream or
        durable has no leader: core NATS, no reply subject, ``taken`` the subject a sidecar that takes
        it answers on (``Sie-Taken``)."""
        subject = direct_subject(work_subject("default", "cpu", "default", item.job.model_id))
        msg = self.message(item, request_items)
        headers = dict(msg.headers)
        if taken is not None:
            headers[H_TAKEN] = taken
        await self.nc.publish(subject, msg.payload, headers=headers)

    async def publish_raw(self, model_id: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        await self.js.publish(work_subject("default", "cpu", "default", model_id), data, headers=headers)

    async def wait_for(self, work_item_ids: list[str], timeout: float = 60.0) -> dict[str, list[WorkResult]]:
        deadline = time.monotonic() + timeout
        while not all(w in self.results for w in work_item_ids):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [w for w in work_item_ids if w not in self.results]
                raise AssertionError(f"no result for {missing}")
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(remaining, 0.5))
        return {w: self.results[w] for w in work_item_ids}


async def start_lane(settings: SidecarSettings) -> tuple[LaneConsumer, object, IpcClient]:
    from sidecar.main import start_sidecar

    return await start_sidecar(settings)


async def stop_lane(lane: LaneConsumer, nc, client: IpcClient) -> None:
    await lane.stop(drain_timeout_s=2.0)
    await client.close()
    with contextlib.suppress(Exception):
        await nc.close()


async def connect(url: str):
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)


async def heartbeats(nc, parse: Callable[[bytes], T]) -> list[T]:
    """Every heartbeat published from now on (``sie.health.>``), each as ``parse`` reads it, in
    the order they come."""
    heard: list[T] = []

    async def on_health(msg) -> None:
        heard.append(parse(msg.data))

    await nc.subscribe(f"{HEALTH_PREFIX}.>", cb=on_health)
    return heard


async def settled_consumer(js, stream: str, durable: str, timeout: float = 10.0):
    """The consumer's info once every delivered message is acked and nothing waits.

    A result reaches the gateway before the sidecar's ack for it reaches the server (the ack
    follows the publish), so a check made the moment the last result arrives would race it."""

    async def settled():
        info = await js.consumer_info(stream, durable)
        return info if info.num_ack_pending == 0 and info.num_pending == 0 else None

    return await wait_until(settled, timeout, what=f"consumer {durable} settled")
