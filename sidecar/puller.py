"""A lane durable's deliveries, each handed on the moment it arrives, on pull requests kept here.

nats-py's ``fetch`` returns a batch. After the first message of a lingering pull it waits for the
rest of the batch, or for a status, until the request's timeout; and a status left over from an
earlier request (a ``408`` that reached the client after the client's own timer fired) ends the
next fetch's first probe, so that fetch falls back to a lingering pull and then holds its first
message until the timeout. Measured through the cluster at one client: after an idle spell, every
request took about a second (the pull timeout) in two of four tries.

Here a :class:`Puller` keeps at most one pull request open on the server, on a reply subject of its
own (``<inbox>.<n>``). A delivery goes to the callback as soon as it arrives; a status (``404``,
``408``, ``409``, ``503``) ends only the request whose subject it came on, so one left over from an
earlier request changes nothing. With one request open, what is still owed is exact: the batch
asked for less what was delivered. The caller opens the next request when this one ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DEFAULT_PREFIX

log = logging.getLogger("sie.sidecar")

STATUS = "Status"  # the header nats-py fills from a status line ("NATS/1.0 408 Request Timeout")
HEARTBEAT = "100"
ENDED_NORMALLY = ("404", "408")  # no messages (no_wait), request expired
# past its expiry plus this, an open request is forgotten even if its 408 never came (a reconnect)
GRACE_S = 1.0


@dataclass
class _Request:
    token: str
    owed: int  # messages the server may still deliver on it
    deadline: float  # time.monotonic()


class Puller:
    def __init__(
        self,
        nc: NATS,
        stream: str,
        durable: str,
        on_message: Callable[[Msg], Awaitable[None]],
        *,
        expires_s: float,
        wake: asyncio.Event,
        api_prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.nc = nc
        self.on_message = on_message
        self.expires_s = expires_s
        self.wake = wake  # set whenever the open request ends (the caller may ask again)
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._prefix = nc.new_inbox()
        self._tokens = itertools.count()
        self._open: _Request | None = None
        self._sub: Subscription | None = None
        # failed requests (no consumer, consumer deleted, ...) since the last good answer
        self.failures = 0
        self.last_failure = ""

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self._prefix + ".*", cb=self._on_msg)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        self._open = None
        if sub is not None:
            await sub.unsubscribe()

    @property
    def owed(self) -> int:
        """Messages the open request may still bring (0 when none is open)."""
        self._forget_overdue()
        return self._open.owed if self._open is not None else 0

    @property
    def is_open(self) -> bool:
        self._forget_overdue()
        return self._open is not None

    def seconds_left(self) -> float | None:
        """Until the open request is forgotten without its status; None when none is open."""
        if self._open is None:
            return None
        return max(0.0, self._open.deadline - time.monotonic())

    async def request(self, batch: int) -> None:
        """Open a pull request for ``batch`` messages that lingers ``expires_s`` on the server."""
        if self._open is not None:
            raise RuntimeError("a pull request is open already")
        token = str(next(self._tokens))
        self._open = _Request(token, batch, time.monotonic() + self.expires_s + GRACE_S)
        body = json.dumps({"batch": batch, "expires": int(self.expires_s * 1e9)}).encode()
        try:
            await self.nc.publish(self._next_subject, body, reply=f"{self._prefix}.{token}")
        except BaseException:
            self._open = None
            raise

    def forget(self) -> None:
        """Count the open request as over (its connection is gone); the caller may open another."""
        if self._open is not None:
            self._end()

    def _forget_overdue(self) -> None:
        if self._open is not None and time.monotonic() >= self._open.deadline:
            log.debug("pull request %s forgotten: no answer after its expiry", self._open.token)
            self._end()

    def _end(self) -> None:
        self._open = None
        self.wake.set()

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(STATUS) if msg.headers else None
        if status is None:  # a delivery (its subject is the work subject, not our inbox)
            self.failures = 0
            if self._open is not None:
                self._open.owed -= 1
                if self._open.owed <= 0:
                    self._end()
            await self.on_message(msg)
            return
        if status == HEARTBEAT:
            return
        token = msg.subject[len(self._prefix) + 1 :]
        if self._open is None or token != self._open.token:
            return  # the answer of a request already over
        if status not in ENDED_NORMALLY:
            self.failures += 1
            description = msg.headers.get("Description", "") if msg.headers else ""
            self.last_failure = f"{status} {description}".strip()
        else:
            self.failures = 0
        self._end()
