"""Gateway process wiring: read settings, connect NATS, build the app, serve HTTP.

Start it with ``python -m gateway`` (settings from ``SIE_*`` environment variables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import nats
from aiohttp import web

from gateway.app import GATEWAY_KEY, create_app
from gateway.registry import CatalogRegistry
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")


async def serve(settings: GatewaySettings) -> None:
    registry = CatalogRegistry.from_dirs(settings.models_dir, settings.bundles_dir)
    log.info("model registry: %d routable ids from %s", len(registry.routable_ids()), settings.models_dir)
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
        settings.nats_url,
        name="sie-gateway",
        max_reconnect_attempts=-1,
        reconnect_time_wait=2,
        connect_timeout=5,
        reconnected_cb=reconnected,
        disconnected_cb=disconnected,
        error_cb=error_cb,
    )
    app = create_app(settings, nc, registry)
    holder["app"] = app
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.gateway_host, settings.gateway_port)
    await site.start()
    log.info(
        "gateway %s listening on %s:%d (NATS %s)",
        app[GATEWAY_KEY].router_id,
        settings.gateway_host,
        settings.gateway_port,
        settings.nats_url,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # non-POSIX
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("gateway shutting down")
        await runner.cleanup()
        await nc.drain()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(GatewaySettings()))


if __name__ == "__main__":
    main()
