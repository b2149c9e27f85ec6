"""A clock for tests (``protocol.clock.Clock``) whose time moves only when the test moves it.

``advance(s)`` moves time and fires the waits whose deadlines it passes. ``settled()`` returns once
every task waiting on the clock is blocked with nothing to wake it (its event unset, its deadline
not reached): the code under test has done all it can until time moves or something arrives. So a
test says "nothing ran yet" or "it ran without waiting for its deadline" without sleeping.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class _Wait:
    event: asyncio.Event
    deadline: float | None
    timer: asyncio.Future[None]

    @property
    def blocked(self) -> bool:
        return not self.event.is_set() and not self.timer.done()


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._waits: list[_Wait] = []
        self._changed: asyncio.Event | None = None

    def now(self) -> float:
        return self._now

    @property
    def t(self) -> float:
        return self._now

    @property
    def waiting(self) -> int:
        """Waits in progress (a part blocked on this clock)."""
        return len(self._waits)

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._waits if w.deadline is not None), default=None)

    def advance(self, seconds: float) -> None:
        """Move time forward; the waits whose deadline is reached return."""
        assert seconds >= 0
        self._now += seconds
        for wait in self._waits:
            if wait.deadline is not None and wait.deadline <= self._now and not wait.timer.done():
                wait.timer.set_result(None)

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else self._now + timeout
        wait = _Wait(event, deadline, loop.create_future())
        if deadline is not None and deadline <= self._now:
            wait.timer.set_result(None)
        self._waits.append(wait)
        self._notify()
        waiter = loop.create_task(event.wait())
        try:
            await asyncio.wait([waiter, wait.timer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            wait.timer.cancel()
            self._waits.remove(wait)

    async def settled(self) -> None:
        """Until some task waits on this clock and every waiting one is blocked."""
        while not (self._waits and all(w.blocked for w in self._waits)):
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
