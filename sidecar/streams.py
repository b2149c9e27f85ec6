"""Ensure the pool work stream and the lane durable (same settings as the gateway: protocol.streams)."""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from protocol.streams import RECONCILED_STREAM_FIELDS, lane_consumer_config, stream_config
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar.streams")


def _norm(value):
    return getattr(value, "value", value)


async def ensure_stream(js: JetStreamContext, settings: SidecarSettings) -> str:
    """Create ``WORK_POOL_{pool}`` or reconcile it in place (never its storage); returns its name."""
    cfg = stream_config(
        settings.pool,
        storage=settings.stream_storage,
        max_age_s=settings.stream_max_age_s,
        replicas=settings.stream_replicas,
    )
    name = cfg["name"]
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(StreamConfig(**cfg))
            log.info("created stream %s (%s storage)", name, cfg["storage"])
            return name
        except BadRequestError:
            info = await js.stream_info(name)  # another creator won the race
    current = info.config
    wanted = StreamConfig(**cfg)
    if _norm(current.storage) != cfg["storage"]:
        log.warning(
            "stream %s has %s storage, settings ask for %s: storage cannot change in place (drain and recreate it)",
            name,
            _norm(current.storage),
            cfg["storage"],
        )
    differs = [f for f in RECONCILED_STREAM_FIELDS if _norm(getattr(current, f)) != _norm(getattr(wanted, f))]
    if differs:
        wanted.storage = current.storage
        try:
            await js.update_stream(wanted)
            log.info("reconciled stream %s (%s)", name, ", ".join(differs))
        except Exception as exc:  # noqa: BLE001 - keep serving with the stream as it is
            log.warning("could not reconcile stream %s: %s", name, exc)
    return name


async def ensure_lane_consumer(js: JetStreamContext, stream: str, settings: SidecarSettings) -> str:
    """Create (or update) the lane durable shared by every pod of the lane; returns its name."""
    cfg = lane_consumer_config(
        settings.pool,
        settings.machine_profile,
        settings.bundle,
        ack_wait_s=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=settings.max_ack_pending,
    )
    try:
        await js.add_consumer(stream, ConsumerConfig(**cfg))
    except BadRequestError as exc:
        # A durable with a config the server will not update in place: replace it.
        log.warning("recreating consumer %s: %s", cfg["durable_name"], exc)
        await js.delete_consumer(stream, cfg["durable_name"])
        await js.add_consumer(stream, ConsumerConfig(**cfg))
    return cfg["durable_name"]
