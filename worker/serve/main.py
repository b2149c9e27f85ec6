"""Wiring of ``sie serve``: settings → runtime → aiohttp app on host:port.

With ``SIE_MODEL_PROCESSES=N`` (default: 4 on CUDA, 1 on CPU) the first process starts N-1 siblings and all N bind the same port
(SO_REUSEPORT; the kernel spreads connections over them). Each sibling is a whole worker — its own
runtime, batcher and inference thread on the same device — so HTTP parsing, tokenisation and
response encoding of one never hold the GIL that another's inference thread needs. The first
process restarts a sibling that exits; siblings exit with it (protocol/siblings.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from iokit import eventloop
from protocol import tracing
from protocol.logs import setup_logging
from worker.processes import resolve_processes, start_siblings
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_runtime(settings: WorkerSettings | None = None) -> Runtime:
    """The runtime as every worker front door builds it (HTTP here, IPC in worker.ipc)."""
    return Runtime(settings or WorkerSettings())


def _say_listening(settings: WorkerSettings) -> Callable[[str], None]:
    """run_app calls this once every site listens: one line a user (and a script) can wait for."""

    def say(_banner: str) -> None:
        print(f"sie serve listening on http://{settings.host}:{settings.port}", flush=True)

    return say


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _say_auth(settings: WorkerSettings) -> None:
    """One line on how requests are authenticated (how many keys, never the keys themselves); a
    warning when the server is open on an address other machines may reach."""
    keys = settings.api_keys()
    if keys:
        log.info("sie serve: bearer keys required (%d configured, SIE_API_KEY)", len(keys))
    elif settings.host not in LOOPBACK:
        log.warning(
            "sie serve: open to anyone who reaches %s:%d; pass --api-key (SIE_API_KEY) or --host 127.0.0.1",
            settings.host,
            settings.port,
        )


def main(settings: WorkerSettings | None = None) -> None:
    settings = settings or WorkerSettings()
    setup_logging(settings.log_level, settings.log_format)
    tracing.setup_tracing("sie-serve")
    settings = resolve_processes(settings)
    shared = settings.model_processes > 1
    siblings = start_siblings(settings, "worker.serve.main")
    if siblings:
        log.info("sie serve: %d processes on port %d", settings.model_processes, settings.port)
    if settings.process_index == 0:
        _say_auth(settings)
    try:
        runtime = build_runtime(settings)
        app = create_app(runtime, settings)
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            access_log=None,
            reuse_port=shared,
            loop=eventloop.new_event_loop(),
            print=_say_listening(settings) if settings.process_index == 0 else None,
        )
    finally:
        if siblings:
            siblings.stop()
        tracing.shutdown()


if __name__ == "__main__":
    main()
