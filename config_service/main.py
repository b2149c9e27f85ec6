"""Wiring of the config service: settings → store (migrated) → writer lock → publisher → HTTP.

``python -m config_service`` or ``config_service.main:main()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from config_service.app import Auth, create_app
from config_service.forward import WriteForwarder
from config_service.lock import make_writer_lock
from config_service.metrics import ConfigMetrics
from config_service.publisher import DeltaPublisher
from config_service.rules import CatalogLoadError, load_baseline_models, load_bundles
from config_service.service import ConfigService
from config_service.settings import ConfigServiceSettings
from config_service.store import Store, make_engine, migrate
from iokit import eventloop
from protocol import heap
from protocol.logs import setup_logging

log = logging.getLogger("config_service")


async def serve(settings: ConfigServiceSettings, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    router_id = settings.router_id()
    engine = make_engine(settings.db_url())
    revision = await asyncio.to_thread(migrate, engine)
    log.info(
        "config store %s at schema revision %s", engine.url.render_as_string(hide_password=True), revision
    )

    catalog_error = None
    bundles, baseline = {}, {}
    try:
        bundles = load_bundles(settings.bundles_dir)
        baseline = load_baseline_models(settings.models_dir)
    except CatalogLoadError as exc:
        catalog_error = str(exc)
        log.error("model catalog unavailable: %s", exc)

    metrics = ConfigMetrics()
    lock = make_writer_lock(engine, poll_s=settings.config_lock_poll_s, holder=router_id)
    publisher = None
    if settings.nats_url:
        publisher = DeltaPublisher(
            settings.nats_url,
            name=router_id,
            connect_timeout_s=settings.nats_connect_timeout_s,
            on_state=lambda up: metrics.nats_connected.set(1 if up else 0),
        )
    service = ConfigService(
        store=Store(engine),
        lock=lock,
        publisher=publisher,
        bundles=bundles,
        baseline=baseline,
        router_id=router_id,
        metrics=metrics,
        catalog_error=catalog_error,
        threshold_routing_enabled=settings.threshold_routing_enabled,
        idempotency_ttl_s=settings.config_idempotency_ttl_s,
    )
    auth = Auth(
        admin_token=settings.admin_token or None,
        read_token=settings.config_read_token or None,
        inference_token=settings.auth_token or None,
        production=settings.is_production(),
    )
    forwarder = WriteForwarder(service, settings.advertise_url())
    app = create_app(
        service,
        auth,
        max_body_bytes=settings.config_max_body_bytes,
        body_timeout_s=settings.config_body_timeout_s,
        forwarder=forwarder,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.config_host, settings.config_port)
    await site.start()
    heap.freeze()  # what start-up built lives as long as the process (protocol/heap.py)
    log.info("config service %s listening on %s:%s", router_id, settings.config_host, settings.config_port)

    tasks = [
        asyncio.create_task(lock.maintain(), name="config-writer-lock"),
        asyncio.create_task(
            announce_while_writer(service, settings.advertise_url(), settings.config_lock_poll_s),
            name="config-writer-announce",
        ),
    ]
    if publisher is not None:
        tasks.append(publisher.start())
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await runner.cleanup()
        await forwarder.close()
        if publisher is not None:
            await publisher.close()
        await asyncio.to_thread(lock.close)
        engine.dispose()


async def announce_while_writer(service: ConfigService, url: str, poll_s: float) -> None:
    """Each time this replica takes the writer lock, record its address for the standbys."""
    while True:
        await service.lock.acquired.wait()
        try:
            await service.announce_writer(url)
        except Exception as exc:  # noqa: BLE001 - the lock went again, or the store is down: retry
            log.warning("could not record this writer's address: %s", exc)
            await asyncio.sleep(poll_s)
            continue
        while service.lock.held:
            await asyncio.sleep(poll_s)


def main() -> None:
    settings = ConfigServiceSettings()
    setup_logging(settings.log_level, settings.log_format)
    logging.getLogger("alembic").setLevel(logging.WARNING)

    async def run() -> None:
        await serve(settings, eventloop.stop_event())

    eventloop.run(run())


if __name__ == "__main__":
    main()
