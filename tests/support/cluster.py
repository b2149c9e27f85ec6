"""Helpers for tests that run the cluster shape (gateway, sidecar, worker) as processes."""

from __future__ import annotations

import contextlib
import time

import httpx


def wait_for_worker(url: str, timeout: float = 90.0, headers: dict[str, str] | None = None,
                    profile: str = "cpu") -> dict:
    """Until the gateway at ``url`` sees a live worker of ``profile`` (other profiles do not count)."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            body = httpx.get(url + "/health", timeout=2, headers=headers).json()
            if profile in body.get("live_gpu_types", []):
                return body
        time.sleep(0.2)
    raise AssertionError(f"no live {profile} worker seen by {url}: {body}")
