"""A clock that moves only when the test says so, for parts that take a ``sidecar.clock.Clock``.

``now()`` is what the test set; ``wait(event, timeout_s)`` returns when the event is set or when
:meth:`ManualClock.advance` moves the time to its deadline. Nothing sleeps, so which batch is cut
when depends on the steps the test takes and on nothing else.
"""

from __future__ import annotations

import asyncio


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._timers: list[tuple[float, asyncio.Event]] = []

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        if event.is_set():
            return
        if timeout_s <= 0:
            await asyncio.sleep(0)  # as a timer that is due: let others run once
            return
        timer = asyncio.Event()
        entry = (self.t + timeout_s, timer)
        self._timers.append(entry)
        waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(timer.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            if entry in self._timers:
                self._timers.remove(entry)

    @property
    def waiting(self) -> int:
        """Waits in progress (a part blocked on this clock)."""
        return len(self._timers)

    def next_deadline(self) -> float | None:
        return min((due for due, _ in self._timers), default=None)

    def advance(self, seconds: float) -> None:
        """Move the time on; every wait whose deadline is reached returns."""
        self.t += seconds
        for due, timer in list(self._timers):
            if due <= self.t:
                timer.set()
