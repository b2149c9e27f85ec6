"""Request ids the gateway abandoned (``work_cancel.{router_id}.{request_id}``), kept for a while."""

from __future__ import annotations

import time
from collections import OrderedDict

from protocol.subjects import WORK_CANCEL_PREFIX


def request_id_from_cancel_subject(subject: str) -> str | None:
    """``work_cancel.{router_id}.{request_id}`` → request_id (None if the subject is malformed)."""
    parts = subject.split(".", 2)
    if len(parts) != 3 or parts[0] != WORK_CANCEL_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[2]


class Tombstones:
    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._entries[request_id] = time.monotonic() + self.ttl_s
        self._entries.move_to_end(request_id)
        self._expire()

    def __contains__(self, request_id: object) -> bool:
        expiry = self._entries.get(request_id) if isinstance(request_id, str) else None
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._entries[request_id]  # type: ignore[arg-type]
            return False
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            key, expiry = next(iter(self._entries.items()))
            if expiry < now or len(self._entries) > self.max_entries:
                del self._entries[key]
            else:
                break
