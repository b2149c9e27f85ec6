"""One call per key at a time: requests that need the same answer share the call under way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def one_at_a_time(
    calls: dict[str, asyncio.Task[T]], key: str, call: Callable[[], Awaitable[T]], name: str
) -> asyncio.Task[T]:
    """The call under way for ``key`` in ``calls``, or a new one started there: at most one per key
    at a time, forgotten as it ends. Its outcome is retrieved even when nobody waits for it (callers
    await it shielded, so one that gives up does not cancel the others' call)."""
    task = calls.get(key)
    if task is None:

        async def run() -> T:
            try:
                return await call()
            finally:
                calls.pop(key, None)

        task = asyncio.get_running_loop().create_task(run(), name=name)
        task.add_done_callback(_retrieved)
        calls[key] = task
    return task


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
