"""Wiring of ``sie serve``: settings → runtime → aiohttp app on host:port."""

from __future__ import annotations

import logging

from aiohttp import web

from worker.runtime import Runtime
from worker.serve.app import create_app
from worker.settings import WorkerSettings


def build_runtime(settings: WorkerSettings | None = None) -> Runtime:
    """The runtime as every worker front door builds it (HTTP here, IPC in worker.ipc_server)."""
    return Runtime(settings or WorkerSettings())


def main(settings: WorkerSettings | None = None) -> None:
    settings = settings or WorkerSettings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = build_runtime(settings)
    app = create_app(runtime, settings)
    web.run_app(app, host=settings.host, port=settings.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
