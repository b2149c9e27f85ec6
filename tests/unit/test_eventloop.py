"""The event loop every process runs on, and its stop signal."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from iokit import eventloop


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_sigterm_sets_the_stop_event(monkeypatch: pytest.MonkeyPatch, loop_kind: str) -> None:
    if loop_kind == "asyncio":
        monkeypatch.setenv("SIE_EVENT_LOOP", "asyncio")

    async def main() -> tuple[bool, bool, str]:
        stop = eventloop.stop_event()
        before = stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
        return before, stop.is_set(), type(asyncio.get_running_loop()).__module__

    before, after, module = eventloop.run(main())
    assert (before, after) == (False, True)
    assert module.startswith(loop_kind)
