"""Which API requests this gateway takes: all of them until it drains, and how many are in flight."""

from __future__ import annotations

import asyncio
import time


class Admission:
    def __init__(self) -> None:
        self.draining = False  # set by drain(): new API requests are answered 503, /readyz fails
        self.in_flight = 0  # API requests (/v1/...) being handled, counted by the middleware

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    async def drain(self, timeout_s: float) -> int:
        """Stop taking API requests (each new one is answered ``503 QUEUE_UNAVAILABLE`` with a
        ``Retry-After``, which clients retry, and ``/readyz`` fails) and wait, at most ``timeout_s``,
        for those in flight to be answered. Returns how many were still in flight."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight
