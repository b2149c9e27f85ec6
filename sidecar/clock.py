"""The lane consumer's clock: what its parts read the time from and wait on.

Batch formation (arrival stamps, the wait rule, the bulk window) and the progress-ACK leases read
the time through a :class:`Clock`, so a test can hand the parts a clock it advances by hand and see
exactly which batch is cut when, without sleeping. Production uses :class:`MonotonicClock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        """Return when ``event`` is set or ``timeout_s`` has passed on this clock, whichever is first."""
        ...


class MonotonicClock:
    """``time.monotonic`` and the event loop's timers."""

    now = staticmethod(time.monotonic)

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
