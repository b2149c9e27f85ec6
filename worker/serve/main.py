"""Wiring of ``sie serve``: settings → runtime → aiohttp app on host:port.

With ``SIE_SERVE_PROCESSES=N`` (default: 4 on CUDA, 1 on CPU) the first process starts N-1 siblings and all N bind the same port
(SO_REUSEPORT; the kernel spreads connections over them). Each sibling is a whole worker — its own
runtime, batcher and inference thread on the same device — so HTTP parsing, tokenisation and
response encoding of one never hold the GIL that another's inference thread needs. Siblings exit
with the first process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from aiohttp import web

from protocol import eventloop, tracing
from protocol.logs import setup_logging
from worker import CUDA_PROCESSES
from worker.models.placement import pick_device
from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_runtime(settings: WorkerSettings | None = None) -> Runtime:
    """The runtime as every worker front door builds it (HTTP here, IPC in worker.ipc)."""
    return Runtime(settings or WorkerSettings())


def sibling_env(settings: WorkerSettings, index: int) -> dict[str, str]:
    """The environment of sibling ``index``: every setting of this process (command-line
    overrides included), so the siblings serve exactly what this one serves."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        env[f"SIE_{name.upper()}"] = str(value)
    env["SIE_SERVE_PROCESS_INDEX"] = str(index)
    return env


def _die_with_parent() -> None:
    """Child side of fork: receive SIGTERM when the first process dies (Linux), however it died."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_siblings(settings: WorkerSettings) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "worker.serve.main"],
            env=sibling_env(settings, i),
            preexec_fn=_die_with_parent,
        )
        for i in range(1, settings.serve_processes)
    ]


def stop_siblings(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _say_listening(settings: WorkerSettings) -> Callable[[str], None]:
    """run_app calls this once every site listens: one line a user (and a script) can wait for."""

    def say(_banner: str) -> None:
        print(f"sie serve listening on http://{settings.host}:{settings.port}", flush=True)

    return say


def main(settings: WorkerSettings | None = None) -> None:
    settings = settings or WorkerSettings()
    setup_logging(settings.log_level, settings.log_format)
    tracing.setup_tracing("sie-serve")
    if not settings.serve_processes:
        on_cuda = pick_device(settings.device).startswith("cuda")
        settings = settings.model_copy(update={"serve_processes": CUDA_PROCESSES if on_cuda else 1})
    shared = settings.serve_processes > 1
    siblings = start_siblings(settings) if shared and settings.serve_process_index == 0 else []
    if siblings:
        log.info("sie serve: %d processes on port %d", settings.serve_processes, settings.port)
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
            print=_say_listening(settings) if settings.serve_process_index == 0 else None,
        )
    finally:
        stop_siblings(siblings)
        tracing.shutdown()


if __name__ == "__main__":
    main()
