"""What the sidecar holds: one JetStream delivery, and the per-model queues of held deliveries."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from protocol.work import WorkItem
from sidecar.batcher import Batcher, BatchLimits


@dataclass(eq=False)
class Delivery:
    msg: Msg
    item: WorkItem
    spec: str
    cost: int
    arrived: float  # monotonic, for batching
    received_wall: float  # unix seconds, for queue_ms
    last_progress: float
    settled: bool = False
    in_flight: bool = False

    @property
    def lora_key(self) -> str:
        return self.item.lora or ""

    @property
    def num_delivered(self) -> int:
        try:
            return int(self.msg.metadata.num_delivered or 1)
        except Exception:  # noqa: BLE001 - a message without JetStream metadata
            return 1


@dataclass(eq=False)
class ModelScheduler:
    spec: str
    limits: BatchLimits
    batchers: dict[tuple[str, str], Batcher] = field(default_factory=dict)
    ready: bool = False
    generation: int = -1  # IPC connection generation the readiness was learned on
    running: int = 0  # batches of this model on the worker now
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def batcher(self, op: str, lora_key: str) -> Batcher:
        key = (op, lora_key)
        b = self.batchers.get(key)
        if b is None:
            b = self.batchers[key] = Batcher(op, lora_key)
        return b

    def pending(self) -> list[Delivery]:
        return [d for b in self.batchers.values() for d in b.pending]

    def pending_count(self) -> int:
        return sum(len(b) for b in self.batchers.values())

    def pending_cost(self) -> int:
        return sum(b.pending_cost for b in self.batchers.values())

    def take_all(self) -> list[Delivery]:
        out = []
        for b in self.batchers.values():
            out.extend(b.remove(lambda _e: True))
        return out
