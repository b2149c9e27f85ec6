"""NATS publisher of config deltas (publish-only client, reconnects forever)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats
from nats.aio.client import Client

from protocol.nats_url import failover_options, redacted

log = logging.getLogger(__name__)


class DeltaPublisher:
    """Connects in the background (HTTP binds first) and keeps reconnecting.

    ``ready()`` is the pre-write check: connected and a PING/PONG round trip answered, so a
    write is refused (503) rather than applied without its delta when NATS is unreachable.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str = "sie-config",
        connect_timeout_s: float = 45.0,
        flush_timeout_s: float = 2.0,
        on_state: Callable[[bool], None] | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.on_state = on_state
        self.nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def _state(self, up: bool) -> None:
        if self.on_state:
            self.on_state(up)

    async def _disconnected(self) -> None:
        log.warning("NATS disconnected; config writes answer 503 until it is back")
        self._state(False)

    async def _reconnected(self) -> None:
        log.info("NATS reconnected")
        self._state(True)

    async def _error(self, exc: Exception) -> None:
        log.debug("NATS error: %s", exc)

    async def connect_once(self) -> None:
        self.nc = await nats.connect(
            **failover_options(self.url),
            name=self.name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=2,
            connect_timeout=min(self.connect_timeout_s, 10.0),
            disconnected_cb=self._disconnected,
            reconnected_cb=self._reconnected,
            error_cb=self._error,
        )
        self._state(True)
        log.info("NATS connected to %s", redacted(self.url))

    async def _connect_loop(self) -> None:
        delay = 0.5
        while not self._closing:
            try:
                await asyncio.wait_for(self.connect_once(), self.connect_timeout_s)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "NATS connect to %s failed (%s); retrying in %.1fs", redacted(self.url), exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._connect_loop(), name="config-nats-connect")
        return self._task

    async def ready(self) -> bool:
        if self.nc is None or not self.nc.is_connected:
            return False
        try:
            await self.nc.flush(timeout=self.flush_timeout_s)  # type: ignore[arg-type]  # seconds, a float
        except Exception:
            return False
        return self.connected

    async def publish(self, messages: list[tuple[str, bytes]]) -> list[str]:
        """Publish every (subject, payload) then flush; returns the subjects that failed."""
        failed: list[str] = []
        if self.nc is None or not self.nc.is_connected:
            return [s for s, _ in messages]
        for subject, payload in messages:
            try:
                await self.nc.publish(subject, payload)
            except Exception as exc:
                log.warning("publish to %s failed: %s", subject, exc)
                failed.append(subject)
        try:
            await self.nc.flush(timeout=self.flush_timeout_s)  # type: ignore[arg-type]  # seconds, a float
        except Exception as exc:
            log.warning("NATS flush after publishing deltas failed: %s", exc)
            return [s for s, _ in messages]
        return failed

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.drain()
            with contextlib.suppress(Exception):
                await self.nc.close()
