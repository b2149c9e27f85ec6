"""Pool requests and answers (``/v1/pools``), and the backoff of a failed lease renewal.

A pool is a lease on the gateway; it expires unless renewed. After ``create_pool`` the client
renews it every ``lease_renewal_interval_s`` (60 s by default) until ``delete_pool`` or ``close``
(:func:`sdk._calls.renew_lease`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import cast

from sdk.errors import PoolError
from sdk.types import PoolInfo, PoolSpec

RENEW_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 10.0)  # for the default 60 s interval


def renewal_backoff(interval_s: float) -> tuple[float, ...]:
    """The waits between the retries of a failed renewal, scaled down with a shorter renewal
    interval (tests use short ones)."""
    return tuple(delay * min(1.0, interval_s / 60.0) for delay in RENEW_BACKOFF_S)


def create_body(
    name: str,
    *,
    gpus: Mapping[str, int] | None,
    gpu_caps: Mapping[str, int] | None,
    bundle: str | None,
    minimum_worker_count: int | None,
    pinned_models: list[str] | None,
    queue_pool: str | None,
) -> PoolSpec:
    if not name:
        raise ValueError("a pool needs a name")
    if minimum_worker_count is not None and minimum_worker_count < 0:
        raise ValueError("minimum_worker_count must be >= 0")
    given = {
        "gpus": None if gpus is None else dict(gpus),
        "gpu_caps": None if gpu_caps is None else dict(gpu_caps),
        "queue_pool": queue_pool,
        "bundle": bundle,
        "minimum_worker_count": minimum_worker_count,
        "pinned_models": None if pinned_models is None else list(pinned_models),
    }
    return cast(PoolSpec, {"name": name, **{k: v for k, v in given.items() if v is not None}})


def _object(body: bytes) -> dict[str, object] | None:
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def error(name: str, status: int, body: bytes) -> PoolError:
    data = _object(body) or {}
    detail = data.get("detail", data.get("error"))
    message = detail.get("message") if isinstance(detail, dict) else detail
    code = detail.get("code") if isinstance(detail, dict) else None
    if not message or not isinstance(message, str):
        message = body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    return PoolError(f"pool {name!r}: {message}", pool_name=name, status_code=status, code=code)


def created(name: str, status: int, body: bytes) -> None:
    if status >= 400:
        raise error(name, status, body)
    data = _object(body)
    if data is None:
        raise PoolError(
            f"pool {name!r}: the gateway answered with no pool object", pool_name=name, status_code=status
        )
    state = data.get("status")
    if isinstance(state, dict) and state.get("state") == "expired":
        raise PoolError(f"pool {name!r} has expired", pool_name=name, state="expired", status_code=status)


def info(name: str, status: int, body: bytes) -> PoolInfo | None:
    if status == 404:
        return None
    if status >= 400:
        raise error(name, status, body)
    data = _object(body)
    if data is None:
        raise PoolError(f"pool {name!r}: malformed pool response", pool_name=name, status_code=status)
    return cast(
        PoolInfo,
        {
            "name": data.get("name") or name,
            "spec": data.get("spec") or {},
            "status": data.get("status") or {},
        },
    )


def deleted(name: str, status: int, body: bytes) -> bool:
    if status == 404:
        return False
    if status >= 400:
        raise error(name, status, body)
    return True
