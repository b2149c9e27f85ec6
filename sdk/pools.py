"""Pool requests and the background lease renewal (``POST /v1/pools/{name}/renew``).

A pool is a lease on the gateway; it expires unless renewed. After ``create_pool`` the
client renews it every ``interval_s`` (60 s by default) until ``delete_pool`` or
``close``. A failed renewal is retried a few times with a short backoff, then the renewer
waits for the next cycle (the lease TTL is far longer than the interval).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sdk.errors import PoolError

log = logging.getLogger("sdk.pools")

RENEW_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 10.0)  # for the default 60 s interval


def _backoff(attempt: int, interval_s: float) -> float:
    """The retry backoff, scaled down with a shorter renewal interval (tests use short ones)."""
    return RENEW_BACKOFF_S[attempt] * min(1.0, interval_s / 60.0)


def create_body(
    name: str,
    *,
    gpus: Mapping[str, int] | None,
    gpu_caps: Mapping[str, int] | None,
    bundle: str | None,
    minimum_worker_count: int | None,
    pinned_models: list[str] | None,
    queue_pool: str | None,
) -> dict[str, Any]:
    if not name:
        raise ValueError("a pool needs a name")
    if minimum_worker_count is not None and minimum_worker_count < 0:
        raise ValueError("minimum_worker_count must be >= 0")
    body: dict[str, Any] = {"name": name}
    if gpus is not None:
        body["gpus"] = dict(gpus)
    if gpu_caps is not None:
        body["gpu_caps"] = dict(gpu_caps)
    if queue_pool is not None:
        body["queue_pool"] = queue_pool
    if bundle is not None:
        body["bundle"] = bundle
    if minimum_worker_count is not None:
        body["minimum_worker_count"] = minimum_worker_count
    if pinned_models is not None:
        body["pinned_models"] = list(pinned_models)
    return body


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def error(name: str, status: int, body: bytes) -> PoolError:
    data = _json(body)
    message = None
    code = None
    if isinstance(data, dict):
        detail = data.get("detail", data.get("error"))
        if isinstance(detail, dict):
            message = detail.get("message")
            code = detail.get("code")
        elif isinstance(detail, str):
            message = detail
    if not message:
        message = body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    return PoolError(f"pool {name!r}: {message}", pool_name=name, status_code=status, code=code)


def created(name: str, status: int, body: bytes) -> dict[str, Any]:
    if status >= 400:
        raise error(name, status, body)
    data = _json(body)
    if not isinstance(data, dict):
        raise PoolError(
            f"pool {name!r}: the gateway answered with no pool object", pool_name=name, status_code=status
        )
    state = data.get("status")
    if isinstance(state, dict) and state.get("state") == "expired":
        raise PoolError(f"pool {name!r} has expired", pool_name=name, state="expired", status_code=status)
    return data


def info(name: str, status: int, body: bytes) -> dict[str, Any] | None:
    if status == 404:
        return None
    if status >= 400:
        raise error(name, status, body)
    data = _json(body)
    if not isinstance(data, dict):
        raise PoolError(f"pool {name!r}: malformed pool response", pool_name=name, status_code=status)
    return {
        "name": data.get("name") or name,
        "spec": data.get("spec") or {},
        "status": data.get("status") or {},
    }


def deleted(name: str, status: int, body: bytes) -> bool:
    if status == 404:
        return False
    if status >= 400:
        raise error(name, status, body)
    return True


class ThreadRenewer:
    """Renews one pool lease from a daemon thread (sync client)."""

    def __init__(self, name: str, renew: Callable[[], bool], interval_s: float) -> None:
        self.name = name
        self._renew = renew
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sie-pool-renew-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for attempt in range(len(RENEW_BACKOFF_S) + 1):
                if self._stop.is_set():
                    return
                try:
                    if self._renew():
                        break
                except Exception as exc:  # a renewal failure must never kill the loop
                    log.debug("renewing pool %s failed: %s", self.name, exc)
                if attempt < len(RENEW_BACKOFF_S) and self._stop.wait(_backoff(attempt, self._interval)):
                    return
            else:
                log.warning("could not renew the lease of pool %s; trying again next cycle", self.name)

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


class TaskRenewer:
    """Renews one pool lease from a task in the client's event loop (async client)."""

    def __init__(self, name: str, renew: Callable[[], Awaitable[bool]], interval_s: float) -> None:
        self.name = name
        self._renew = renew
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sie-pool-renew-{self.name}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            for attempt in range(len(RENEW_BACKOFF_S) + 1):
                try:
                    if await self._renew():
                        break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("renewing pool %s failed: %s", self.name, exc)
                if attempt < len(RENEW_BACKOFF_S):
                    await asyncio.sleep(_backoff(attempt, self._interval))
            else:
                log.warning("could not renew the lease of pool %s; trying again next cycle", self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if asyncio.current_task() is not None and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
