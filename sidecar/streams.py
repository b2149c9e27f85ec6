"""Ensure the pool work stream and the lane durable (same settings as the gateway: protocol.streams)."""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from protocol.streams import (
    CONTRACT_STREAM_FIELDS,
    lane_consumer_config,
    reconcile_stream,
    stream_config,
    stream_fields,
)
from protocol.subjects import INTERACTIVE
from sidecar.settings import SidecarSettings

log = logging.getLogger("sie.sidecar.streams")


async def ensure_stream(js: JetStreamContext, settings: SidecarSettings) -> str:
    """Create ``WORK_POOL_{pool}`` when missing; on an existing stream reconcile only the contract
    fields (subjects, discard policy). Its limits (max age, max messages, replicas) belong to the
    gateway's settings, so a sidecar never resets an operator's ``SIE_STREAM_MAX_MSGS``."""
    cfg = stream_config(
        settings.pool,
        storage=settings.stream_storage,
        max_age_s=settings.stream_max_age_s,
        replicas=settings.stream_replicas,
    )
    name = str(cfg["name"])
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(StreamConfig(**cfg))
            log.info("created stream %s (%s storage)", name, cfg["storage"])
            return name
        except BadRequestError:
            info = await js.stream_info(name)  # another creator won the race
    plan = reconcile_stream(stream_fields(info.config), cfg, fields=CONTRACT_STREAM_FIELDS)
    if plan.storage_mismatch:
        log.warning(
            "stream %s has %s storage, settings ask for %s: storage cannot change in place (drain and recreate it)",
            name,
            *plan.storage_mismatch,
        )
    if plan.action == "update":
        try:
            await js.update_stream(StreamConfig(**plan.config))
            log.info("reconciled stream %s (%s)", name, ", ".join(plan.changed))
        except Exception as exc:  # noqa: BLE001 - keep serving with the stream as it is
            log.warning("could not reconcile stream %s: %s", name, exc)
    return name


async def ensure_lane_consumer(
    js: JetStreamContext, stream: str, settings: SidecarSettings, priority: str = INTERACTIVE
) -> str:
    """Create (or update) the lane durable of ``priority`` shared by every pod of the lane; returns its name."""
    cfg = lane_consumer_config(
        settings.pool,
        settings.machine_profile,
        settings.bundle,
        priority=priority,
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
    return str(cfg["durable_name"])
