"""The execution barrier between batches and config changes.

Batches hold it shared while their RunBatch is on the worker; a config apply holds it exclusively:
it waits for the batches in flight, and batches that want to start meanwhile wait for it (writer
preference, so a steady stream of batches cannot starve a config change). Without it a batch could
run against a model the apply is about to unload (a changed profile), fail with MODEL_LOADING and
spend a delivery for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ExecutionBarrier:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @property
    def shared_holders(self) -> int:
        return self._shared

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and self._exclusive_waiting == 0)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._exclusive_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            finally:
                self._exclusive_waiting -= 1
                self._cond.notify_all()  # a cancelled waiter must not keep batches blocked
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()
