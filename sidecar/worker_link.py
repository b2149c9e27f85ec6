"""The lane's calls to the worker over IPC, typed: Ping, EnsureModelReady, RunBatch, Drain, Metrics.

Every IPC method the lane consumer uses goes through :class:`WorkerLink`, which sees the
connection only through :class:`IpcCaller` (:class:`sidecar.ipc_client.IpcClient`). The parts
above it take and return the typed messages of :mod:`protocol.ipc`; a change of those types is a
change of this module. Failures are the client's: :class:`sidecar.ipc_client.IpcTransportError`
(no answer) and :class:`sidecar.ipc_client.IpcRemoteError` (the worker said no, with its code).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from protocol import ipc
from protocol.work_codec import WorkCodec


class IpcCaller(Protocol):
    @property
    def generation(self) -> int:
        """Increases with every new connection (a restarted worker has no models loaded)."""
        ...

    async def call(
        self,
        method: str,
        body: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        traceparent: str | None = None,
    ) -> dict[str, Any]: ...


class WorkerLink:
    def __init__(self, client: IpcCaller) -> None:
        self.client = client

    @property
    def generation(self) -> int:
        return self.client.generation

    async def ping(self, timeout_s: float, pinned: list[str] | None = None) -> ipc.PingResponse:
        """Ping the worker; ``pinned``: the models it is to keep loaded for its pools (None: unchanged)."""
        request: dict[str, object] = {"timestamp_ms": int(time.time() * 1000)}
        if pinned is not None:
            request["pinned_models"] = list(pinned)
        body = await self.client.call(ipc.PING, request, timeout_s=timeout_s)
        return ipc.PingResponse.from_map(body)

    async def ensure_model_ready(self, spec: str, timeout_s: float) -> ipc.EnsureModelReadyResponse:
        body = await self.client.call(ipc.ENSURE_MODEL_READY, {"model_id": spec}, timeout_s=timeout_s)
        return ipc.EnsureModelReadyResponse.from_map(body)

    async def run_batch(
        self, request: ipc.RunBatchRequest, timeout_s: float, traceparent: str | None
    ) -> dict[str, list[ipc.ItemOutcome]]:
        """Run one batch; the outcomes by work item id (in the worker's order for an id sent twice)."""
        body = await self.client.call(
            ipc.RUN_BATCH, request.to_map(), timeout_s=timeout_s, traceparent=traceparent
        )
        return WorkCodec.outcomes(body)

    async def drain(self, deadline_s: float) -> None:
        """Ask the worker to finish what it holds within ``deadline_s`` and take nothing new."""
        await self.client.call(ipc.DRAIN, {"deadline_ms": int(deadline_s * 1000)}, timeout_s=deadline_s + 1)

    async def metrics_text(self, timeout_s: float) -> bytes:
        """The worker's Prometheus exposition (``sie_worker_*``)."""
        body = await self.client.call(ipc.METRICS, {}, timeout_s=timeout_s)
        text = body.get("text")
        if not isinstance(text, bytes):
            raise ValueError("Metrics answer without text")
        return text
