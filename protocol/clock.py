"""The time that batching reads and waits by: the monotonic clock, or one a test moves by hand.

The worker's BatchFormer and the sidecar's lane parts (batch formation, leases, Ping cadence) ask
two things of time: what time it is, and to block until something happens or a deadline passes.
Both go through a :class:`Clock`, so a test can hold time still, move it by exact amounts, and see
when the code blocks (``tests/support/clock.py``), instead of sleeping and hoping the loop ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        """Return once ``event`` is set, or once ``timeout`` seconds have passed (None: no limit)."""
        ...


class MonotonicClock:
    """``time.monotonic`` and the event loop's own timers."""

    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        if timeout is None:
            await event.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


MONOTONIC = MonotonicClock()
