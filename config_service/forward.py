"""A standby replica forwards the writes it is sent to the writer.

The replica holding the writer lock records in the database where it takes writes (its advertised
URL, ``SIE_CONFIG_ADVERTISE_URL``), in a transaction only the lock's holder can run. A standby sent
a write reads that address and passes the request on (method, path, body, ``Authorization``,
``Idempotency-Key``, content type), once: a forwarded request carries ``X-SIE-Config-Forwarded`` and
is never forwarded again. When there is no writer to reach (it died and no replica has taken the
lock yet), the answer is ``503 not_writer`` with ``Retry-After``, which admin clients retry.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from config_service.rules import ConfigError
from config_service.service import ConfigService

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-SIE-Config-Forwarded"  # set on a forwarded write: the standby's router id
WRITER_HEADER = "X-SIE-Config-Writer"  # on a forwarded write's answer: the writer that took it
PASSED_HEADERS = ("Authorization", "Idempotency-Key", "Content-Type", "Accept")
RETRY_AFTER_S = 1


class WriteForwarder:
    def __init__(self, service: ConfigService, advertise_url: str, timeout_s: float = 30.0) -> None:
        self.service = service
        self.advertise_url = advertise_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.forwarded = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def should_forward(self, request: web.Request) -> bool:
        return not self.service.lock.held and FORWARDED_HEADER not in request.headers

    async def forward(self, request: web.Request, body: bytes) -> web.Response:
        """The writer's answer to ``request`` (sent again there with ``body``), or 503 not_writer."""
        writer = await self.service.writer_address()
        if writer is None or writer[0].rstrip("/") == self.advertise_url:
            # With nobody to forward to, a broken catalog here is the cause to report: the
            # lock may be taken in a moment, but the write would still fail on this replica.
            self.service.require_catalog()
            raise not_writer("no replica holds the config writer lock right now")
        url, router_id = writer
        headers = {k: request.headers[k] for k in PASSED_HEADERS if k in request.headers}
        headers[FORWARDED_HEADER] = self.service.router_id
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.request(
                request.method, url.rstrip("/") + request.rel_url.path_qs, data=body, headers=headers
            ) as resp:
                payload = await resp.read()
                self.forwarded += 1
                return web.Response(
                    status=resp.status,
                    body=payload,
                    content_type=resp.content_type,
                    headers={WRITER_HEADER: router_id},
                )
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("forwarding a write to the writer %s at %s failed: %s", router_id, url, exc)
            raise not_writer(f"the writer {router_id} did not answer ({type(exc).__name__})") from None


def not_writer(why: str) -> ConfigError:
    return ConfigError(
        503, "not_writer", f"this replica is a standby and could not forward the write: {why}; retry"
    )
