"""IPC client of the worker: one Unix-socket connection multiplexing concurrent calls by request_id."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

from iokit import frames
from protocol import ipc

log = logging.getLogger("sie.sidecar.ipc")


class IpcError(Exception):
    """Base of IPC call failures; ``code`` is the worker's ``IPC_*`` error code (None: no answer)."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class IpcTransportError(IpcError):
    """The worker could not be reached or the connection broke mid-call (retryable)."""


class IpcRemoteError(IpcError):
    """The worker answered ``ok=false`` (a logical error; no reconnect)."""


class IpcClient:
    """Connects lazily, reconnects on the next call after a failure.

    ``generation`` increases with every new connection, so callers can tell that the worker may have
    restarted since they last asked it something (a restarted worker has no models loaded).
    """

    def __init__(
        self, socket_path: str, *, timeout_s: float = 60.0, max_frame_bytes: int = ipc.MAX_FRAME_BYTES
    ) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.generation = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._closed = False
        # Called with the reason when an open connection is lost (the worker died or closed it),
        # before the calls in flight on it fail: the lane reacts to the event, not to a timer.
        self.on_disconnect: Callable[[str], None] | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def _ensure_connected(self) -> None:
        if self.connected:
            return
        async with self._connect_lock:
            if self.connected:
                return
            if self._closed:
                raise IpcTransportError("client closed")
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except (OSError, ConnectionError) as exc:
                raise IpcTransportError(f"cannot connect to {self.socket_path}: {exc}") from exc
            self._reader, self._writer = reader, writer
            self.generation += 1
            self._read_task = asyncio.create_task(self._read_loop(reader, writer))

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = "connection closed by the worker"
        try:
            while True:
                payload = await frames.read_frame_bytes(reader, max_bytes=self.max_frame_bytes)
                if payload is None:
                    break
                try:
                    envelope = ipc.decode_payload(payload)
                except ipc.FrameError as exc:
                    log.warning("ignoring malformed IPC response: %s", exc)
                    continue
                fut = self._pending.pop(str(envelope.get("request_id")), None)
                if fut is None or fut.done():
                    if envelope.get("request_id") is None and envelope.get("error"):
                        log.warning("worker reported: %s", envelope.get("error"))
                    continue
                if envelope.get("ok"):
                    body = envelope.get("body")
                    fut.set_result(body if isinstance(body, dict) else {})
                else:
                    code = envelope.get("error_code")
                    fut.set_exception(
                        IpcRemoteError(
                            str(envelope.get("error") or "worker error"),
                            code=str(code) if code else None,
                        )
                    )
        except asyncio.CancelledError:
            reason = "client closed"
            raise
        except (ipc.FrameError, ConnectionError, OSError) as exc:
            reason = f"connection broken: {exc}"
        finally:
            self._drop(writer, reason)

    def _drop(self, writer: asyncio.StreamWriter, reason: str) -> None:
        lost = self._writer is writer and not self._closed
        if self._writer is writer:
            self._reader = self._writer = None
        writer.close()
        if lost and self.on_disconnect is not None:
            try:
                self.on_disconnect(reason)
            except Exception:  # noqa: BLE001 - never let a callback break the connection cleanup
                log.exception("on_disconnect callback failed")
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(IpcTransportError(reason))

    async def call(
        self,
        method: str,
        body: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        traceparent: str | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its response body."""
        await self._ensure_connected()
        writer = self._writer
        if writer is None:
            raise IpcTransportError("not connected")
        request_id = str(next(self._ids))
        try:
            frame = ipc.encode_frame(
                ipc.request_envelope(method, request_id, body, traceparent=traceparent),
                max_bytes=self.max_frame_bytes,
            )
        except ipc.FrameTooLarge as exc:
            raise IpcRemoteError(str(exc), code=ipc.IPC_TOO_LARGE) from exc
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        try:
            async with self._write_lock:
                writer.write(frame)
                await writer.drain()
        except (ConnectionError, OSError) as exc:
            self._pending.pop(request_id, None)
            self._drop(writer, f"write failed: {exc}")
            raise IpcTransportError(f"write failed: {exc}") from exc
        try:
            return await asyncio.wait_for(fut, timeout_s or self.timeout_s)
        except TimeoutError as exc:
            self._pending.pop(request_id, None)
            raise IpcTransportError(f"{method} timed out") from exc

    async def close(self) -> None:
        self._closed = True
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._read_task
        if self._writer is not None:
            self._drop(self._writer, "client closed")
