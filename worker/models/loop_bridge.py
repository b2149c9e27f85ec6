"""From a worker thread (a model load, a forward on a forward thread), run a coroutine on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ON_LOOP_TIMEOUT_S = 300.0  # a worker thread waiting on the loop (evictions) never hangs past this


class LoopBridge:
    def __init__(self, timeout_s: float = ON_LOOP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def bound(self) -> bool:
        return self._loop is not None

    def bind(self) -> None:
        """On the loop: the loop later calls from threads go to."""
        self._loop = asyncio.get_running_loop()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """From a thread that is not the loop's: ``coro``'s result, once the loop has run it."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the loop bridge is not bound to a running loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=self.timeout_s)
