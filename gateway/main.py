"""Gateway process wiring: read settings, connect NATS, build the app, serve HTTP.

Start it with ``python -m gateway`` (settings from ``SIE_*`` environment variables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats
from aiohttp import web

from gateway.app import GATEWAY_KEY, create_app
from gateway.config_sync import ConfigServiceRegistry
from gateway.k8s_scaler import K8sScalerSettings, build_scaler
from gateway.parts import ADMISSION_KEY
from gateway.registry import CatalogRegistry, ModelRegistry
from gateway.settings import GatewaySettings
from iokit import eventloop
from protocol import heap, tracing
from protocol.logs import setup_logging
from protocol.nats_url import failover_options, redacted

log = logging.getLogger("gateway")
HEAR_WORKERS_S = 1.0  # before it listens, a gateway waits at most this long for the first heartbeat


def build_registry(settings: GatewaySettings) -> ModelRegistry:
    """The config service's mirror when SIE_CONFIG_SERVICE_URL is set, else the catalog YAML dirs."""
    if settings.config_service_url:
        log.info(
            "model registry: config service %s (poll every %.0f s)",
            settings.config_service_url,
            settings.config_poll_interval_s,
        )
        return ConfigServiceRegistry(
            settings.config_service_url,
            token=settings.config_service_token,
            poll_interval_s=settings.config_poll_interval_s,
            http_timeout_s=settings.config_http_timeout_s,
            backoff_max_s=settings.config_bootstrap_backoff_max_s,
        )
    registry = CatalogRegistry.from_dirs(settings.models_dir, settings.bundles_dir)
    log.info("model registry: %d routable ids from %s", len(registry.routable_ids()), settings.models_dir)
    return registry


async def serve(settings: GatewaySettings, stop: asyncio.Event | None = None) -> None:
    registry = build_registry(settings)
    holder: dict[str, web.Application] = {}

    async def reconnected() -> None:
        log.info("NATS reconnected")
        app = holder.get("app")
        if app is not None:
            app[GATEWAY_KEY].on_reconnect()

    async def disconnected() -> None:
        log.warning("NATS disconnected")

    async def error_cb(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    nc = await nats.connect(
        **failover_options(settings.nats_url),
        name="sie-gateway",
        max_reconnect_attempts=-1,
        reconnect_time_wait=2,
        connect_timeout=2,  # a stopped member must not hold a reconnect for long (protocol/nats_url.py)
        reconnected_cb=reconnected,
        disconnected_cb=disconnected,
        error_cb=error_cb,
    )
    app = create_app(settings, nc, registry)
    holder["app"] = app
    # no access log line per request (it cost ~9% of the gateway's CPU); metrics count requests
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()  # the gateway starts: it asks every sidecar for its heartbeat
    # listen once the live workers are known: replicas sharing a port (sie up --gateways N) get
    # connections as soon as they listen, and a gateway that knows no worker answers PROVISIONING
    await app[GATEWAY_KEY].heartbeats.hear_workers(HEAR_WORKERS_S)
    site = web.TCPSite(
        runner, settings.gateway_host, settings.gateway_port, reuse_port=settings.gateway_reuse_port or None
    )
    await site.start()
    # batches send their lines to this gateway's own front door, on loopback
    app[GATEWAY_KEY].run_batches(f"http://127.0.0.1:{runner.addresses[0][1]}")
    heap.freeze()  # what start-up built lives as long as the process (protocol/heap.py)
    log.info(
        "gateway %s listening on %s:%d (NATS %s)",
        app[GATEWAY_KEY].router_id,
        settings.gateway_host,
        settings.gateway_port,
        redacted(settings.nats_url),
    )
    scaler_task: asyncio.Task[None] | None = None
    scaler_settings = K8sScalerSettings()
    scaler = build_scaler(scaler_settings)  # None unless SIE_GATEWAY_K8S_SCALER_ENABLED
    if scaler is not None:
        gw = app[GATEWAY_KEY]
        scaler_task = asyncio.create_task(
            scaler.run(
                lambda: gw.demand.pending().keys(), gw.lanes.lane_served, scaler_settings.scaler_interval_s
            ),
            name="k8s-scaler",
        )
        log.info("k8s scale-from-zero on for %d StatefulSets", len(scaler.targets))
    if stop is None:
        stop = eventloop.stop_event()
    try:
        await stop.wait()
        admission = app[ADMISSION_KEY]
        log.info("gateway draining: new requests answered 503, waiting for %d in flight", admission.in_flight)
        left = await admission.drain(settings.gateway_drain_timeout_s)
        if left:
            log.warning("gateway drain timed out with %d request(s) still in flight", left)
    finally:
        log.info("gateway shutting down")
        if scaler_task is not None:
            scaler_task.cancel()
            with contextlib.suppress(BaseException):
                await scaler_task
        await runner.cleanup()
        await nc.drain()


def main() -> None:
    settings = GatewaySettings()
    setup_logging(settings.log_level, settings.log_format)
    tracing.setup_tracing("sie-gateway")
    try:
        eventloop.run(serve(settings))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
