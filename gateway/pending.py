"""The requests this gateway waits on: for each, the slots its results fill and what was sent for
it, so that items whose results were lost can be sent again."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast

from gateway.routing import Lane
from protocol.subjects import lane_durable
from protocol.work import WorkResult
from protocol.work_codec import WorkMessage


@dataclass
class Collector:
    total: int
    results: list[WorkResult | None]
    future: asyncio.Future[list[WorkResult]]
    remaining: int = field(init=False)
    # what was published, kept (by reference: the caller holds it anyway) until the request ends, so
    # that items whose results were lost while this gateway was cut off can be sent again
    subject: str = ""
    sent: list[WorkMessage] = field(default_factory=list)
    published: bool = False  # every item acknowledged by the stream
    redispatches: int = 0
    request_id: str = ""
    lane: Lane | None = None
    progress_at: float = 0.0  # time.monotonic() of its start, then of its latest result
    direct_at: float | None = None  # when its unanswered items were last sent on the direct path
    # the messages (by first slot) sent on the direct path that no sidecar has said it took
    untaken: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.remaining = sum(1 for r in self.results if r is None)

    @property
    def durable(self) -> str:
        lane = self.lane
        return lane_durable(lane.pool, lane.machine_profile, lane.bundle, lane.priority) if lane else ""

    def missing(self) -> list[WorkMessage]:
        """Its messages that carry an item without a result."""
        return [m for m in self.sent if any(self.results[slot] is None for slot in m.slots)]

    def missing_untaken(self) -> list[WorkMessage]:
        """Its messages sent on the direct path that no sidecar took, and still without a result."""
        return [m for m in self.missing() if m.slots[0] in self.untaken]

    def put(self, result: WorkResult) -> None:
        idx = result.item_index
        if not isinstance(idx, int) or not 0 <= idx < self.total:
            return
        if self.results[idx] is None:
            self.remaining -= 1
            self.progress_at = time.monotonic()
        self.results[idx] = result  # a duplicate delivery overwrites its slot
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(cast(list[WorkResult], self.results))  # every slot is filled


class PendingRequests:
    """The collectors of the requests in flight, by request id."""

    def __init__(self) -> None:
        self._collectors: dict[str, Collector] = {}

    def add(self, col: Collector) -> None:
        self._collectors[col.request_id] = col

    def remove(self, request_id: str) -> None:
        self._collectors.pop(request_id, None)

    def get(self, request_id: str) -> Collector | None:
        return self._collectors.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._collectors

    def __len__(self) -> int:
        return len(self._collectors)

    def snapshot(self) -> list[Collector]:
        """Every collector now (callers may await between them, and the table change meanwhile)."""
        return list(self._collectors.values())

    def cancel_all(self) -> None:
        for col in self._collectors.values():
            if not col.future.done():
                col.future.cancel()
