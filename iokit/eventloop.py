"""The event loop every sie-cluster process runs on: uvloop where it is installed (Linux, macOS),
else asyncio's own.

The cluster path is bound by per-message event-loop work in Python (aiohttp requests, NATS
messages, IPC frames): uvloop's loop and transports in C cut that work for the gateway, sidecar,
worker and config service alike. ``SIE_EVENT_LOOP=asyncio`` keeps asyncio's loop (to compare, or
to rule uvloop out)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _uvloop() -> Any | None:
    if os.environ.get("SIE_EVENT_LOOP", "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the loop of :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


def stop_event() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets (where the loop can take signals): a process's cue to
    drain and stop. Call it on the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # non-POSIX
            loop.add_signal_handler(sig, stop.set)
    return stop
