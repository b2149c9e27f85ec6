"""The worker's queue-mode front door: an IPC server on a Unix domain socket.

The sidecar forms batches and calls ``RunBatch``; this module turns IPC requests into calls on the
worker Runtime and its answers into ItemOutcomes. Every request runs as its own task, so one
connection multiplexes concurrent calls (a slow batch never delays a Ping); responses carry the
request's ``request_id``.

``python -m worker.ipc`` builds the worker settings and runtime like ``sie serve`` does and
serves ``WorkerSettings.ipc_socket_path`` (``SIE_IPC_SOCKET_PATH``, default ``/tmp/sie-ipc.sock``) until SIGTERM/SIGINT.
With ``SIE_MODEL_PROCESSES=N`` (default: 4 on CUDA, 1 on CPU) it starts N-1 sibling workers on the
same device, process ``i`` on its own socket and worker id (protocol/siblings.py), each served by the
sidecar process of the same index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

from iokit import eventloop, frames
from protocol import ipc, tracing
from protocol.errors import ErrorCode, SIEError
from protocol.jobs import JobItem
from protocol.logs import setup_logging
from protocol.priority import INTERACTIVE, PRIORITIES
from protocol.siblings import process_socket, process_worker_id
from protocol.work import WorkResult
from protocol.work_codec import WorkCodec
from worker.ipc.config_calls import ConfigCalls, ConfigRuntime
from worker.metrics import WorkerMetrics
from worker.models.registry import EnsureResult
from worker.settings import WorkerSettings

log = logging.getLogger("sie.worker.ipc")

DEFAULT_SOCKET_PATH = "/tmp/sie-ipc.sock"
DRAIN_MAX_S = 25.0


class WorkerRuntime(ConfigRuntime, Protocol):
    """What the IPC front door needs of the runtime (:class:`worker.runtime.Runtime` is one): the
    config calls' part, and what Ping, EnsureModelReady, RunBatch and Metrics read."""

    @property
    def ready(self) -> bool: ...

    @property
    def metrics(self) -> WorkerMetrics: ...

    def loaded_models(self) -> list[str]: ...

    def loading_models(self) -> list[str]: ...

    def profile_states(self) -> dict[str, tuple[str, str | None]]: ...

    def weights_status(self) -> dict[str, str]: ...

    def set_pool_pins(self, specs: list[str]) -> None: ...

    def pinned_models(self) -> list[str]: ...

    async def ensure_ready(self, spec: str) -> EnsureResult: ...

    async def run_work_items(
        self, items: list[JobItem], *, priority: str = INTERACTIVE
    ) -> list[WorkResult]: ...


class IpcHandler:
    """Method dispatch over a :class:`WorkerRuntime` (config calls: :mod:`worker.ipc.config_calls`)."""

    def __init__(self, runtime: WorkerRuntime, *, worker_id: str | None = None) -> None:
        self.runtime = runtime
        self.config = ConfigCalls(runtime)
        self.worker_id = worker_id or socket.gethostname()
        self.draining = False
        self._inflight: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.last_ping_monotonic: float | None = None

    # ---- dispatch --------------------------------------------------------------------------
    async def handle(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """The response body of one call; raises IpcMethodError for a logical error."""
        if method == ipc.PING:
            return self.ping(body)
        if method == ipc.ENSURE_MODEL_READY:
            return await self.ensure_model_ready(body)
        if method == ipc.RUN_BATCH:
            return await self._tracked(self.run_batch(body))
        if method == ipc.DRAIN:
            return await self.drain(body)
        if method == ipc.APPLY_MODEL_CONFIG:
            return await self.config.apply_model_config(body)
        if method == ipc.REPLACE_MODEL_CONFIGS:
            return await self.config.replace_model_configs(body)
        if method == ipc.METRICS:
            return {"text": self.runtime.metrics.render()}
        raise IpcMethodError(f"unknown method {method!r}")

    async def _tracked(self, coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        if self.draining:
            coro.close()
            raise IpcMethodError(ipc.DRAINING_ERROR, code=ipc.IPC_DRAINING)
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        self._idle.clear()
        try:
            return await coro
        finally:
            self._inflight.discard(task)
            if not self._inflight:
                self._idle.set()

    # ---- methods ---------------------------------------------------------------------------
    def ping(self, body: dict[str, Any]) -> dict[str, Any]:
        self.last_ping_monotonic = time.monotonic()
        pins = body.get("pinned_models")
        if isinstance(pins, list) and all(isinstance(p, str) for p in pins):
            self.runtime.set_pool_pins(pins)
        states = self.runtime.profile_states()
        return ipc.PingResponse(
            timestamp_ms=int(body.get("timestamp_ms") or time.time() * 1000),
            worker_id=self.worker_id,
            ready=not self.draining and self.runtime.ready,
            bundle_config_hash=self.config.bundle_hash(),
            loaded_models=list(self.runtime.loaded_models()),
            loading_models=list(self.runtime.loading_models()),
            model_states={spec: state for spec, (state, _) in states.items()},
            failed_models={spec: err for spec, (state, err) in states.items() if state == "failed" and err},
            weights=self.runtime.weights_status(),
            pinned_models=self.runtime.pinned_models(),
        ).to_map()

    async def ensure_model_ready(self, body: dict[str, Any]) -> dict[str, Any]:
        spec = body.get("model_id")
        if not isinstance(spec, str) or not spec:
            raise IpcMethodError("EnsureModelReady needs model_id")
        if self.draining:
            return ipc.EnsureModelReadyResponse(
                state=ipc.STATE_RETRY_LATER, error=ipc.DRAINING_ERROR, error_code=ipc.IPC_DRAINING
            ).to_map()
        try:
            res = await self.runtime.ensure_ready(spec)
        except SIEError as exc:
            return self._ensure_error(exc)
        resp = ipc.EnsureModelReadyResponse(
            state=res.state if res.state in ipc.ENSURE_STATES else ipc.STATE_RETRY_LATER,
            max_batch_tokens=res.max_batch_tokens,
            batch_budget=res.max_batch_requests,
            forwards_in_flight=res.forwards_in_flight or None,
            forward_lanes=res.forward_threads or None,
        )
        if res.error is not None:
            resp.error = res.error.message
            resp.error_code = res.error.code
            if resp.state == ipc.STATE_FAILED and resp.error_code in (
                ErrorCode.MODEL_LOADING,
                ErrorCode.RESOURCE_EXHAUSTED,
            ):
                resp.state = ipc.STATE_RETRY_LATER
        return resp.to_map()

    @staticmethod
    def _ensure_error(exc: SIEError) -> dict[str, Any]:
        # Unknown model, bad profile, ...: a permanent answer the sidecar publishes; anything
        # retryable becomes retry_later.
        from protocol.errors import RETRYABLE_CODES

        state = ipc.STATE_RETRY_LATER if exc.code in RETRYABLE_CODES else ipc.STATE_FAILED
        return ipc.EnsureModelReadyResponse(state=state, error=exc.message, error_code=exc.code).to_map()

    async def run_batch(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            req = ipc.RunBatchRequest.from_map(body)
            items, dead = WorkCodec.job_items(req)
        except (TypeError, ValueError) as exc:
            raise IpcMethodError(f"malformed RunBatch: {exc}") from exc
        if dead:
            log.warning("%d undecodable work items in a batch of %s", len(dead), req.model_id)
        if not items:
            return ipc.run_batch_response(dead)
        started = time.perf_counter()
        try:
            priority = req.priority if req.priority in PRIORITIES else INTERACTIVE
            results = await self.runtime.run_work_items(items, priority=priority)
        except SIEError as exc:
            results = [self._error_result(it, exc.code, exc.message, exc.retry_after) for it in items]
        except Exception as exc:  # a runtime bug must not take down the connection
            log.exception("run_work_items failed for a batch of %d items of %s", len(items), req.model_id)
            results = [self._error_result(it, ErrorCode.INTERNAL_ERROR, str(exc), None) for it in items]
        if len(results) != len(items):
            log.error("runtime returned %d results for %d items", len(results), len(items))
            results = [
                self._error_result(it, ErrorCode.INTERNAL_ERROR, "result count mismatch", None)
                for it in items
            ]
        elapsed_ms = (time.perf_counter() - started) * 1000
        worker_id = req.worker_id if isinstance(req.worker_id, str) and req.worker_id else self.worker_id
        outcomes = dead
        for item, res in zip(items, results, strict=True):
            res.worker_id = worker_id
            if not res.processing_ms:
                res.processing_ms = elapsed_ms
            res.work_item_id = res.work_item_id or item.work_item_id
            outcomes.append(ipc.outcome_from_result(res))
        return ipc.run_batch_response(outcomes)

    def _error_result(self, item: JobItem, code: str, message: str, retry_after: float | None) -> WorkResult:
        return WorkResult.failure(item, code, message, retry_after_s=retry_after, worker_id=self.worker_id)

    async def drain(self, body: dict[str, Any]) -> dict[str, Any]:
        """Stop accepting batches; wait for in-flight ones up to min(25 s, ``deadline_ms`` from now)."""
        self.draining = True
        deadline_ms = body.get("deadline_ms")
        budget = DRAIN_MAX_S
        if isinstance(deadline_ms, (int, float)) and deadline_ms > 0:
            budget = min(budget, deadline_ms / 1000.0)  # deadline_ms: the drain budget in milliseconds
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), budget)
        return {"acknowledged": True, "inflight": len(self._inflight)}


class IpcMethodError(Exception):
    """A logical error answered with ``ok=false`` (the client neither retries nor reconnects)."""

    def __init__(self, message: str, *, code: str = ipc.IPC_BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class IpcServer:
    """asyncio Unix-socket server around an IpcHandler."""

    def __init__(
        self, handler: IpcHandler, socket_path: str, *, max_frame_bytes: int = ipc.MAX_FRAME_BYTES
    ) -> None:
        self.handler = handler
        self.socket_path = socket_path
        self.max_frame_bytes = max_frame_bytes
        self._server: asyncio.base_events.Server | None = None
        self._conn_tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> IpcServer:
        path = Path(self.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise RuntimeError(f"{path} exists and is not a socket")
            path.unlink()  # stale socket of a previous run
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._on_connection, path=str(path), backlog=1024)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        log.info("IPC server listening on %s", path)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conn_tasks):
                task.cancel()
            await asyncio.gather(*self._conn_tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_task = asyncio.current_task()
        assert conn_task is not None
        self._conn_tasks.add(conn_task)
        write_lock = asyncio.Lock()
        calls: set[asyncio.Task[Any]] = set()

        async def send(envelope: dict[str, Any]) -> None:
            try:
                frame = ipc.encode_frame(envelope, max_bytes=self.max_frame_bytes)
            except ipc.FrameTooLarge as exc:
                frame = ipc.encode_frame(
                    ipc.error_envelope(
                        envelope.get("request_id"), ipc.IPC_TOO_LARGE, f"response too large: {exc}"
                    )
                )
            except (TypeError, ValueError) as exc:
                frame = ipc.encode_frame(
                    ipc.error_envelope(
                        envelope.get("request_id"), ipc.IPC_INTERNAL, f"unserialisable response: {exc}"
                    )
                )
            async with write_lock:
                writer.write(frame)
                await writer.drain()

        async def call(request_id: Any, method: str, body: dict[str, Any], parent: Any) -> None:
            traced = tracing.span(f"worker.{method}", parent=parent) if isinstance(parent, str) else None
            try:
                with traced or contextlib.nullcontext():
                    result = await self.handler.handle(method, body)
                envelope = ipc.response_envelope(request_id, ok=True, body=result)
            except IpcMethodError as exc:
                envelope = ipc.error_envelope(request_id, exc.code, str(exc))
            except Exception as exc:  # noqa: BLE001 - answer, never drop, a failing call
                log.exception("IPC %s failed", method)
                envelope = ipc.error_envelope(request_id, ipc.IPC_INTERNAL, f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(ConnectionError, OSError):
                await send(envelope)

        try:
            while True:
                try:
                    payload = await frames.read_frame_bytes(reader, max_bytes=self.max_frame_bytes)
                except ipc.FrameTooLarge as exc:
                    # The body was not read: the stream cannot be resynchronised. Say why, then close.
                    log.warning("closing IPC connection: %s", exc)
                    with contextlib.suppress(ConnectionError, OSError):
                        await send(ipc.error_envelope(None, ipc.IPC_TOO_LARGE, str(exc)))
                    break
                except (ipc.FrameError, ConnectionError, OSError):
                    break
                if payload is None:
                    break
                try:
                    request = ipc.decode_payload(payload)
                except ipc.FrameError as exc:
                    # Framing is intact: answer the garbage and keep serving this connection.
                    await send(ipc.error_envelope(None, ipc.IPC_BAD_REQUEST, f"malformed frame: {exc}"))
                    continue
                request_id = request.get("request_id")
                if request.get("version") != ipc.IPC_VERSION:
                    await send(
                        ipc.error_envelope(
                            request_id,
                            ipc.IPC_BAD_REQUEST,
                            f"unsupported IPC version {request.get('version')!r}",
                        )
                    )
                    continue
                method = request.get("method")
                body = request.get("body") or {}
                if not isinstance(method, str) or not isinstance(body, dict):
                    await send(
                        ipc.error_envelope(
                            request_id, ipc.IPC_BAD_REQUEST, "request needs method and a map body"
                        )
                    )
                    continue
                task = asyncio.create_task(call(request_id, method, body, request.get("traceparent")))
                calls.add(task)
                task.add_done_callback(calls.discard)
        except asyncio.CancelledError:
            pass
        finally:
            for task in list(calls):
                task.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._conn_tasks.discard(asyncio.current_task())


async def serve_ipc(runtime: WorkerRuntime, socket_path: str, *, worker_id: str | None = None) -> IpcServer:
    """Start serving ``runtime`` on ``socket_path`` (stale socket unlinked, mode 0600)."""
    return await IpcServer(IpcHandler(runtime, worker_id=worker_id), socket_path).start()


# --------------------------------------------------------------------------- process entry point


async def _amain(settings: WorkerSettings) -> None:
    from worker.processes import resolve_processes, start_siblings
    from worker.runtime import Runtime

    settings = resolve_processes(settings)
    index = settings.process_index
    socket_path = process_socket(settings.ipc_socket_path or DEFAULT_SOCKET_PATH, index)
    worker_id = process_worker_id(settings.worker_id, index)
    siblings = start_siblings(settings, "worker.ipc")
    if siblings:
        log.info("%d model processes on this device; this one on %s", settings.model_processes, socket_path)
    runtime = Runtime(settings)  # as sie serve builds it
    try:
        await runtime.start()
        server = await serve_ipc(runtime, socket_path, worker_id=worker_id)
        stop = eventloop.stop_event()
        try:
            await stop.wait()
            log.info("shutting down: draining in-flight batches")
            if siblings:
                siblings.terminate()  # they drain beside this one
            await server.handler.drain({})
        finally:
            await server.close()
            await runtime.close()
    finally:
        if siblings:
            siblings.terminate()
            await asyncio.to_thread(siblings.wait, DRAIN_MAX_S + 5)


def main() -> None:
    settings = WorkerSettings()
    setup_logging(settings.log_level, settings.log_format)
    tracing.setup_tracing("sie-worker")
    try:
        eventloop.run(_amain(settings))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
