"""What the sidecar holds: one item delivered (a :class:`Delivery`, under the :class:`Lease` of the
JetStream message that carried it), the set of held deliveries, and the per-model queues of them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from protocol.batching import BatchLimits, BatchQueue
from protocol.subjects import INTERACTIVE
from protocol.work_codec import RoutingHeader


@dataclass(eq=False)
class Lease:
    """One JetStream message, held for the items it carries (one, or a chunk's: protocol.work_codec).
    Each item is settled on its own; the message is settled once the last one is: NAKed (with the
    longest delay asked) when any item was, else dead-lettered when one was, else ACKed."""

    msg: Msg
    open: int = 1  # its items not settled yet
    nak_delay_s: float | None = None
    dead_reason: str | None = None
    last_progress: float = 0.0  # the lane's clock: when it came, then its last progress-ACK

    @property
    def num_delivered(self) -> int:
        try:
            return int(self.msg.metadata.num_delivered or 1)
        except Exception:  # noqa: BLE001 - a message without JetStream metadata
            return 1

    def close(self) -> bool:
        """One of its items is settled; True when that was the last."""
        self.open -= 1
        return self.open == 0


@dataclass(eq=False)
class Delivery:
    lease: Lease  # the message that carried it
    body: bytes  # its input as encoded (protocol.work_codec; empty while in the payload store)
    route: RoutingHeader  # its routing header: the sidecar never decodes the body
    # its job as encoded, one object for all the message's deliveries (empty while in the store)
    shared: bytes
    spec: str
    cost: int  # predicted tokens (scheduler's cost_of the character estimate)
    arrived: float  # the lane's clock (protocol.clock), for batching
    received_wall: float  # unix seconds, for queue_ms
    settled: bool = False
    in_flight: bool = False
    estimate: int = 0  # the character estimate the cost was predicted from
    priority: str = INTERACTIVE  # the class of the subject it came on
    request_items: int = (
        1  # its request's items to batch together (1 for a redelivery: its siblings are done)
    )

    @property
    def msg(self) -> Msg:
        return self.lease.msg

    @property
    def group(self) -> str:
        return self.route.group_key

    @property
    def request_id(self) -> str:
        return self.route.request_id

    @property
    def num_delivered(self) -> int:
        return self.lease.num_delivered


def leases_of(deliveries: Iterable[Delivery]) -> list[Lease]:
    """The messages that carry ``deliveries`` and still hold an unsettled item, each once."""
    return list({id(d.lease): d.lease for d in deliveries if not d.settled}.values())


class Held:
    """Every delivery the sidecar holds (queued, in a batch, or being settled), until it is settled.

    A pull loop that waits for room to pull more watches it with an event (:meth:`watch`): every
    release sets the events of the loops watching.
    """

    def __init__(self) -> None:
        self._deliveries: set[Delivery] = set()
        self._watchers: dict[str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._deliveries)

    def __bool__(self) -> bool:
        return bool(self._deliveries)

    def __iter__(self) -> Iterator[Delivery]:
        return iter(self._deliveries)

    def __contains__(self, d: object) -> bool:
        return d in self._deliveries

    def add(self, d: Delivery) -> None:
        self._deliveries.add(d)

    def release(self, d: Delivery) -> None:
        """``d`` is settled: no longer held; wake the loops waiting for room."""
        d.settled = True
        self._deliveries.discard(d)
        for event in self._watchers.values():
            event.set()

    def count(self, priority: str) -> int:
        return sum(1 for d in self._deliveries if d.priority == priority)

    def watch(self, key: str, event: asyncio.Event) -> None:
        """Set ``event`` at every release from now until :meth:`unwatch` of ``key``."""
        self._watchers[key] = event

    def unwatch(self, key: str) -> None:
        self._watchers.pop(key, None)


@dataclass(eq=False)
class ModelScheduler:
    spec: str
    limits: BatchLimits  # changed in place when EnsureModelReady tells the model's own
    # its queued deliveries, by (operation, group key) and priority class, and the batching policy
    queue: BatchQueue[Delivery] = field(init=False)
    ready: bool = False
    generation: int = -1  # IPC connection generation the readiness was learned on
    running: int = 0  # batches of this model on the worker now
    bulk_running: int = 0  # of which bulk batches
    depth: int = 0  # interactive batches the worker takes at once for this model (0 = not told)
    concurrent_forwards: int = 1  # of those, how many forward passes run at once
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # tokens per unit of the character estimate, learned from what the worker counted: batches are
    # cut on tokens (the worker's unit) without the sidecar tokenising
    tokens_per_estimate: float = 1.0

    def __post_init__(self) -> None:
        self.queue = BatchQueue(self.limits)

    def cost_of(self, estimate: int) -> int:
        return max(1, round(estimate * self.tokens_per_estimate))

    def learn(self, estimate: int, tokens: int) -> None:
        """Fold one item's real token count into the ratio (an average over about 50 items)."""
        if estimate > 0 and tokens > 0:
            self.tokens_per_estimate += 0.02 * (tokens / estimate - self.tokens_per_estimate)

    def add(self, d: Delivery) -> None:
        """Queue ``d`` (its ``cost`` set) for the policy to batch."""
        self.queue.append(
            d,
            group=(d.route.operation, d.group),
            cost=d.cost,
            arrived=d.arrived,
            priority=d.priority,
            request_id=d.request_id,
            request_items=d.request_items,
        )

    def pending(self) -> list[Delivery]:
        return list(self.queue)

    def pending_count(self, priority: str | None = None) -> int:
        """Queued deliveries (of one priority class, or all)."""
        return len(self.queue) if priority is None else self.queue.count(priority)

    def pending_cost(self) -> int:
        return self.queue.cost

    def take_all(self) -> list[Delivery]:
        return self.queue.remove(lambda _e: True)
