"""The one way a test waits for a condition it cannot be told about: poll it.

``timeout_s`` only guards against a hang (a condition that never comes fails the test with
``what`` instead of blocking it); it is never a claim about speed, so keep it generous.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float = 30.0,
    *,
    interval_s: float = 0.02,
    what: str = "condition",
) -> T:
    """Call ``predicate`` (plain or async) until it returns something true; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s (last: {value!r})")
        await asyncio.sleep(interval_s)
