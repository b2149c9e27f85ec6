"""Sidecar process wiring: settings → NATS (inbox ``_INBOX_WORKER``) → IPC client → LaneConsumer + ConfigApplier."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from iokit import eventloop
from protocol import heap, tracing
from protocol.logs import setup_logging
from protocol.nats_url import failover_options
from protocol.siblings import Siblings
from protocol.subjects import WORKER_INBOX_PREFIX, pin_subject
from sidecar.barrier import ExecutionBarrier
from sidecar.config_sync import ConfigApplier
from sidecar.ipc_client import IpcClient
from sidecar.lane import LaneConsumer
from sidecar.metrics import start_metrics_server
from sidecar.readiness import WorkerHealth
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar")


async def connect_nats(
    settings: SidecarSettings, on_reconnect: list[Callable[[], None]] | None = None
) -> NatsClient:
    """Connect to NATS; each of ``on_reconnect`` (filled in later, once its owner exists) runs after a
    reconnect."""

    async def disconnected() -> None:
        log.warning("NATS disconnected")

    async def reconnected() -> None:
        log.info("NATS reconnected")
        for hook in on_reconnect or ():
            hook()

    async def error_cb(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    return await nats.connect(
        **failover_options(settings.nats_url),
        name=f"sie-sidecar-{settings.worker_id}",
        inbox_prefix=WORKER_INBOX_PREFIX,
        max_reconnect_attempts=-1,
        reconnect_time_wait=2,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        error_cb=error_cb,
    )


async def start_sidecar(settings: SidecarSettings) -> tuple[LaneConsumer, NatsClient, IpcClient]:
    """Connect and start a lane consumer; returns (consumer, nats client, ipc client)."""
    on_reconnect: list[Callable[[], None]] = []
    nc = await connect_nats(settings, on_reconnect)
    client = IpcClient(settings.ipc_socket_path, timeout_s=settings.ipc_request_timeout_s)
    barrier = ExecutionBarrier()
    worker = WorkerHealth()
    config = ConfigApplier(
        nc, client, settings, barrier, current_hash=lambda: worker.ping.bundle_config_hash or ""
    )
    lane = LaneConsumer(nc, client, settings, barrier=barrier, worker=worker, config=config)
    on_reconnect.append(lane.on_reconnect)

    async def on_pins(msg: Msg) -> None:
        if not worker.take_pins(msg.data):
            log.warning("ignoring a malformed pin message on %s", msg.subject)

    try:
        await lane.start()
        await config.start()
        await nc.subscribe(pin_subject(settings.worker_id), cb=on_pins)
    except BaseException:
        with contextlib.suppress(Exception):
            await config.stop()
        await client.close()
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    return lane, nc, client


async def run(settings: SidecarSettings) -> None:
    # process 0 of a pod with several model processes runs a sidecar beside each further one
    siblings = None
    if settings.process_index == 0 and settings.model_processes > 1:
        siblings = Siblings("sidecar", settings.model_processes).start()
    try:
        await _serve(settings, siblings)
    finally:
        if siblings is not None:
            siblings.terminate()
            await asyncio.to_thread(siblings.wait, settings.drain_timeout_s + 5)


async def _serve(settings: SidecarSettings, siblings: Siblings | None) -> None:
    attempt = 0
    while True:
        try:
            lane, nc, client = await start_sidecar(settings)
            break
        except Exception as exc:  # noqa: BLE001 - NATS or JetStream not up yet: retry with backoff
            attempt += 1
            delay = min(10.0, 0.5 * 2**attempt)
            log.warning("sidecar start failed (%s: %s); retrying in %.1f s", type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
    heap.freeze()  # what start-up built lives as long as the process (protocol/heap.py)
    log.info(
        "sidecar %s consuming %s/%s (pool=%s profile=%s bundle=%s), worker at %s",
        settings.worker_id,
        lane.stream,
        lane.durable,
        settings.pool,
        settings.machine_profile,
        settings.bundle,
        settings.ipc_socket_path,
    )
    metrics = None
    if settings.metrics_port:
        metrics = await start_metrics_server(lane, settings.metrics_host, settings.metrics_port)
        log.info("metrics on %s:%d/metrics", settings.metrics_host, settings.metrics_port)
    await eventloop.stop_event().wait()
    log.info("shutting down: tombstone, drain")
    if siblings is not None:
        siblings.terminate()  # they drain beside this one
    try:
        await lane.stop()
    finally:
        if metrics is not None:
            await metrics.cleanup()
        await client.close()
        with contextlib.suppress(Exception):
            await nc.drain()


def main() -> None:
    settings = SidecarSettings().for_process()
    setup_logging(settings.log_level, settings.log_format)
    tracing.setup_tracing("sie-sidecar")
    try:
        eventloop.run(run(settings))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
