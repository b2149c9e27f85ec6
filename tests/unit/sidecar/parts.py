"""Building blocks for the unit tests of the lane consumer's parts: deliveries, a loop that has run
everything it can, and scripted stand-ins for a part's collaborators at its Protocol seams (the
real collaborators are exercised together in tests/integration/sidecar)."""

from __future__ import annotations

import asyncio
import itertools

from nats.aio.msg import Msg

from protocol import ipc
from protocol.subjects import INTERACTIVE
from protocol.work import WorkResult
from protocol.work_codec import RoutingHeader
from sidecar.deliveries import Delivery, Lease, ModelScheduler

MODEL = "test/model"
_ids = itertools.count()


def delivery(
    now: float,
    *,
    request_id: str | None = None,
    request_items: int = 1,
    cost: int = 10,
    operation: str = "encode",
    group: str = "",
    priority: str = INTERACTIVE,
    reply_subject: str = "_INBOX.router.r",
    results_subject: str | None = None,
    msg: Msg | None = None,
) -> Delivery:
    """A delivery as intake makes it, arrived at ``now`` on the lane's clock."""
    n = next(_ids)
    request_id = request_id or f"req-{n}"
    route = RoutingHeader(
        work_item_id=f"{request_id}.{n}",
        request_id=request_id,
        item_index=0,
        reply_subject=reply_subject,
        model_spec=MODEL,
        operation=operation,
        group_key=group,
        cost=cost,
        request_items=request_items,
        results_subject=results_subject,
    )
    msg = msg if msg is not None else Msg(None, subject="sie.work.x", data=b"body")
    return Delivery(
        lease=Lease(msg, last_progress=now),
        body=msg.data,
        shared=b"job",
        route=route,
        spec=MODEL,
        cost=1,
        arrived=now,
        received_wall=0.0,
        estimate=cost,
        priority=priority,
        request_items=request_items,
    )


async def quiesce() -> None:
    """Let every task run until each waits on something only the test can give (an event, the
    manual clock): nothing here does I/O, so a bounded number of loop turns is enough."""
    for _ in range(200):
        await asyncio.sleep(0)


class GatedWorker:
    """RunBatch that records each batch's item ids and answers only once the test opens its gate."""

    def __init__(self) -> None:
        self.generation = 1
        self.batches: list[list[str]] = []
        self.bodies: list[list[bytes]] = []  # what each batch carried to the worker
        self.jobs: list[tuple[list[bytes], list[int]]] = []  # each batch's jobs, and each item's
        self.priorities: list[str] = []  # the class each batch was sent as
        self.gate = asyncio.Event()

    async def run_batch(
        self, request: ipc.RunBatchRequest, timeout_s: float, traceparent: str | None
    ) -> dict[str, list[ipc.ItemOutcome]]:
        ids = list(request.item_ids or [])
        self.batches.append(ids)
        self.bodies.append(list(request.items))
        self.jobs.append((list(request.jobs), list(request.item_job)))
        self.priorities.append(request.priority)
        await self.gate.wait()
        return {i: [ipc.ItemOutcome(i, ipc.PUBLISH_AND_ACK, result=b"r")] for i in ids}

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


class StoredPayloads:
    """The payload store as the scheduler reads it: named objects (iokit.payloads)."""

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects = dict(objects or {})

    async def get(self, name: str) -> bytes:
        import nats.js.errors

        if name not in self.objects:
            raise nats.js.errors.ObjectNotFoundError
        return self.objects[name]


class ReadyModel:
    """EnsureModelReady that always says ready, with the worker's depth and concurrent forwards."""

    def __init__(self, *, depth: int = 1, forwards: int = 1) -> None:
        self.depth = depth
        self.forwards = forwards
        self.ensured = 0

    async def ensure_ready(self, sched: ModelScheduler) -> bool:
        self.ensured += 1
        sched.ready = True
        sched.generation = 1
        sched.depth = self.depth
        sched.concurrent_forwards = self.forwards
        return True

    def transport_nak_delay(self) -> float:
        return 0.5


class RecordingSettler:
    """Settles by recording what it was asked: (action, work item id)."""

    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []

    def _mark(self, action: str, d: Delivery) -> None:
        if not d.settled:
            d.settled = True
            self.done.append((action, d.route.work_item_id))

    async def ack(self, d: Delivery, *, drop: bool = False) -> None:
        self._mark("drop" if drop else "ack", d)

    async def nak(self, d: Delivery, delay_s: float) -> None:
        self._mark(f"nak {delay_s}", d)

    async def progress(self, lease: Lease) -> None:
        self.done.append(("progress", lease.msg.data))

    def error_result(self, d: Delivery, code: str, message: str) -> WorkResult:
        return WorkResult.failure(d.route, code, message, worker_id="w")

    async def publish_and_ack(
        self, d: Delivery, result: WorkResult | bytes, *, success: bool = False
    ) -> None:
        assert isinstance(result, WorkResult)
        self._mark(f"publish {result.error_code}", d)

    async def settle(self, sched: ModelScheduler, d: Delivery, outcome: ipc.ItemOutcome) -> None:
        self._mark(f"settle {outcome.disposition}", d)

    def goes_with_others(self, d: Delivery, outcome: ipc.ItemOutcome) -> bool:
        return False

    async def publish_together(self, results: list[tuple[Delivery, bytes, bool]]) -> None:
        for d, _, _ in results:
            self._mark("together", d)

    def actions(self, action: str) -> list[str]:
        return [i for a, i in self.done if a == action]
