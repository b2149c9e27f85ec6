"""Status streams and capacity waits, shared by the sync and async clients.

``watch()`` reads the server's status WebSocket: ``/ws/cluster-status`` on a gateway (the
``/health`` body, once a second) or ``/ws/status`` on ``sie serve`` (a frame every 200 ms); each
text frame is one JSON object, yielded as a dict. ``mode="auto"`` asks ``GET /health`` whether the
server is a gateway. The WebSocket client is the ``websockets`` package (its sync and asyncio
clients), the one the public sie-sdk uses too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from websockets.asyncio.client import connect as connect_async
from websockets.exceptions import ConnectionClosedOK, InvalidStatus, WebSocketException
from websockets.sync.client import connect as connect_sync

from sdk import _answers as A
from sdk import _wire as W
from sdk._retry import VISIBLE_WAIT_S, Answer, RetryState, Rule, Transport, decide
from sdk.errors import ProvisioningError, RequestError, SIEConnectionError, SIEError

if TYPE_CHECKING:
    from sdk._core import Failure

WatchMode = Literal["auto", "cluster", "worker"]
CLUSTER_PATH = "/ws/cluster-status"
WORKER_PATH = "/ws/status"
# headers of an HTTP request that mean nothing on a WebSocket handshake
_NOT_FOR_WS = {"content-type", "accept"}


def is_gateway(health: Mapping[str, object]) -> bool:
    return health.get("type") == "gateway"


def watch_path(mode: str, gateway: bool | None) -> str:
    if mode == "cluster":
        return CLUSTER_PATH
    if mode == "worker":
        return WORKER_PATH
    if mode != "auto":
        raise ValueError("mode must be 'auto', 'cluster' or 'worker'")
    return CLUSTER_PATH if gateway else WORKER_PATH


def ws_url(base_url: str, path: str) -> str:
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://") :] + path
    if base_url.startswith("http://"):
        return "ws://" + base_url[len("http://") :] + path
    return "ws://" + base_url + path


def ws_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _NOT_FOR_WS}


def _frame(message: str | bytes) -> dict[str, Any]:
    data = json.loads(message.decode("utf-8") if isinstance(message, bytes) else message)
    if not isinstance(data, dict):
        raise json.JSONDecodeError("a status frame must be a JSON object", str(data)[:40], 0)
    return data


def _failed(url: str, exc: Exception) -> SIEError:
    """The SDK error for a status stream that could not be opened or read (``exc`` re-raised when
    it is none of the stream's failures)."""
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        return RequestError(
            f"WebSocket connection failed: {status}", code="websocket_refused", status_code=status
        )
    if isinstance(exc, (WebSocketException, OSError, json.JSONDecodeError)):
        return SIEConnectionError(f"WebSocket error on {url}: {exc}")
    raise exc


def watch_sync(url: str, headers: Mapping[str, str], open_timeout_s: float) -> Iterator[dict[str, Any]]:
    """Every status frame until the server closes the stream."""
    try:
        with connect_sync(url, additional_headers=ws_headers(headers), open_timeout=open_timeout_s) as ws:
            yield from (_frame(message) for message in ws)
    except ConnectionClosedOK:
        return
    except Exception as exc:
        raise _failed(url, exc) from exc


async def watch_async(
    url: str, headers: Mapping[str, str], open_timeout_s: float
) -> AsyncIterator[dict[str, Any]]:
    """Async twin of :func:`watch_sync`."""
    try:
        async with connect_async(
            url, additional_headers=ws_headers(headers), open_timeout=open_timeout_s
        ) as ws:
            async for message in ws:
                yield _frame(message)
    except ConnectionClosedOK:
        return
    except Exception as exc:
        raise _failed(url, exc) from exc


def capacity_timeout_message(gpu: str, elapsed: float) -> str:
    return f"Timeout after {elapsed:.1f}s waiting for GPU '{gpu}' capacity"


def capacity_state(now: float, timeout_s: float | None, *, server_seen: bool) -> RetryState:
    """The bookkeeping of one ``wait_for_capacity(gpu)``: its budget (default 900 s)."""
    return RetryState.start(
        now, provision_timeout_s=timeout_s, wait_for_capacity=True, max_oom_retries=0, server_seen=server_seen
    )


def capacity_wait(
    failed: Failure | None,
    state: RetryState,
    now: float,
    *,
    gpu: str,
    poll_interval_s: float,
    base_url: str,
) -> float:
    """How long ``wait_for_capacity(gpu)`` sleeps before it looks at ``/health`` again, after an
    answer without workers of ``gpu`` (``failed`` None) or a failed look. Raises when the wait ends:
    ``SIEConnectionError`` when the server was never reached (after the quick retries of any
    call), ``ProvisioningError`` when the budget is spent."""
    if failed is not None:
        # GET /health is safe to repeat: every failure after the connection is worth the budget
        kind = Transport.UNREACHED if failed.kind is Transport.UNREACHED else Transport.RETRYABLE
        decision = decide(Answer(transport=kind), state, now)
        reason = A.describe(failed.error)
        if decision.retry:
            A.announce(decision, state, now, what=f"wait_for_capacity {gpu} at {base_url} ({reason})")
            return decision.delay
        if decision.rule is Rule.UNREACHABLE:
            raise A.unreachable("wait_for_capacity", base_url, reason, state) from failed.error
    else:
        state.server_seen = True
    remaining = state.remaining(now)
    if remaining <= 0:
        raise ProvisioningError(capacity_timeout_message(gpu, state.budget_s - remaining), gpu=gpu)
    delay = min(poll_interval_s, remaining)
    state.retries += 1
    state.waited_s += delay
    W.log.log(
        logging.WARNING if state.waited_s >= VISIBLE_WAIT_S else logging.DEBUG,
        "wait_for_capacity %s: no worker of %s at %s yet; next look in %.1f s (%.0f s of the %.0f s budget left)",
        gpu, gpu, base_url, delay, remaining - delay, state.budget_s,
    )  # fmt: skip
    return delay
