"""A test-side lane peer: pulls work items from the lane durable, answers on the reply subject, and
publishes heartbeats on ``sie.health.<id>``. It is a real NATS peer (no mocks), standing in for a
sidecar + worker so gateway behaviour can be tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable

import nats
import nats.js.errors
import numpy as np
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, StreamConfig

from protocol.codec import packb
from protocol.jobs import ExtractJob, JobItem, ScoreInput, ScoreJob
from protocol.streams import PAYLOADS_BUCKET as PAYLOAD_BUCKET
from protocol.streams import lane_consumer_config, stream_config
from protocol.subjects import HEALTH_SOLICIT, INTERACTIVE, health_subject, lane_durable, pool_stream_name
from protocol.work import Heartbeat, WorkResult
from protocol.work_codec import WorkCodec

DIM = 4


def fake_vector(text: str) -> np.ndarray:
    digest = hashlib.sha256(text.encode()).digest()
    return np.frombuffer(digest[: DIM * 4], dtype="<u4").astype(np.float32) / 2**32


def answer(item: JobItem, worker_id: str) -> WorkResult:
    job = item.job
    if isinstance(job, ScoreJob):
        pair = item.input
        assert isinstance(pair, ScoreInput)
        q = pair.query.text or ""
        entries = []
        for i, it in enumerate(pair.items):
            score = float(len(set(q.split()) & set((it.text or "").split())))
            entries.append({"item_id": it.id or f"item-{i}", "score": score})
        entries.sort(key=lambda e: -e["score"])
        for rank, e in enumerate(entries):
            e["rank"] = rank
        body = {"scores": entries}
        if pair.query.id:
            body["query_id"] = pair.query.id
        blob = packb(body)
    elif isinstance(job, ExtractJob):
        text = item.item.text or ""
        label = (job.params.labels or ("thing",))[0]
        ents = [{"text": w, "label": label, "score": 0.9, "start": text.find(w), "end": text.find(w) + len(w), "bbox": None} for w in text.split() if w[:1].isupper()]  # fmt: skip
        blob = packb({"id": item.item.id or f"item-{item.index}", "entities": ents, "relations": [], "classifications": [], "objects": [], "data": {}})  # fmt: skip
    else:
        out: dict = {}
        if item.item.id is not None:
            out["id"] = item.item.id
        out["dense"] = {"dims": DIM, "dtype": "float32", "values": fake_vector(item.item.text or "")}
        blob = packb(out)
    return WorkResult(
        work_item_id=item.work_item_id,
        request_id=item.request_id,
        item_index=item.item_index,
        success=True,
        result_msgpack=blob,
        inference_ms=1.0,
        queue_ms=0.5,
        worker_id=worker_id,
        input_tokens=3,
    )


Handler = Callable[[JobItem, "FakeWorker"], Awaitable[WorkResult | None]]


async def default_handler(item: JobItem, worker: FakeWorker) -> WorkResult | None:
    return answer(item, worker.worker_id)


class FakeWorker:
    def __init__(
        self,
        url: str,
        worker_id: str,
        *,
        pool: str = "default",
        profile: str = "cpu",
        bundle: str = "default",
        loaded: tuple[str, ...] = (),
        consume: bool = True,
        handler: Handler = default_handler,
        ack_wait_s: float = 30.0,
        max_deliver: int = 20,
        heartbeat_s: float = 0.5,
        heartbeat_extra: dict | None = None,
        together: bool = False,
        priority: str = INTERACTIVE,
    ) -> None:
        self.priority = priority  # the lane's durable it pulls: interactive or bulk
        self.url = url
        self.together = (
            together  # each fetch's results in one message to the results subject, as a sidecar sends them
        )
        self.worker_id = worker_id
        self.pool, self.profile, self.bundle = pool, profile, bundle
        self.loaded = list(loaded)
        self.consume = consume
        self.handler = handler
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.heartbeat_s = heartbeat_s
        self.heartbeat_extra = dict(heartbeat_extra or {})  # more Heartbeat fields (hash, model states)
        self.seen: list[JobItem] = []
        self.seen_headers: list[dict[str, str]] = []  # the routing headers of each, as the sidecar reads them
        self.seen_bodies: list[bytes] = []  # the body of each message taken
        self.nc = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def heartbeat(self, *, terminated: bool = False) -> bytes:
        return Heartbeat(
            name=self.worker_id,
            ready=not terminated,
            terminated=terminated,
            machine_profile=self.profile,
            pool_name=self.pool,
            bundle=self.bundle,
            loaded_models=self.loaded,
            **self.heartbeat_extra,
        ).to_json()

    async def start(self) -> FakeWorker:
        self.nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        if self.consume:
            await self._bind()
            self._tasks.append(asyncio.create_task(self._pull_loop()))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        await self.nc.subscribe(HEALTH_SOLICIT, cb=self._on_solicit)  # as a sidecar answers a gateway
        await self.nc.publish(health_subject(self.worker_id), self.heartbeat())
        await self.nc.flush()
        return self

    async def _on_solicit(self, _msg) -> None:
        if not self._stopping:
            await self.nc.publish(health_subject(self.worker_id), self.heartbeat())

    async def _bind(self) -> None:
        js = self.nc.jetstream()
        with contextlib.suppress(nats.js.errors.BadRequestError):
            await js.add_stream(StreamConfig(**stream_config(self.pool)))
        await js.add_consumer(
            pool_stream_name(self.pool),
            ConsumerConfig(
                **lane_consumer_config(
                    self.pool,
                    self.profile,
                    self.bundle,
                    ack_wait_s=self.ack_wait_s,
                    max_deliver=self.max_deliver,
                    priority=self.priority,
                )
            ),
        )
        self.psub = await js.pull_subscribe_bind(
            lane_durable(self.pool, self.profile, self.bundle, self.priority), pool_stream_name(self.pool)
        )

    async def _pull_loop(self) -> None:
        # a stop flag, not only cancellation: nats-py's fetch can turn a cancel into a timeout
        while not self._stopping:
            try:
                msgs = await self.psub.fetch(16, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception:
                await asyncio.sleep(0.2)
                continue
            answered: list[tuple[Msg | None, str | None, WorkResult]] = []
            for msg in msgs:
                if self._stopping:
                    return
                body = msg.data
                ref = WorkCodec.payload_ref(msg.headers)
                if ref is not None:  # too large for a message: in the payload store, as a sidecar reads it
                    body = (await (await self.nc.jetstream().object_store(PAYLOAD_BUCKET)).get(ref)).data
                results: list[WorkResult] = []
                self.seen_bodies.append(body)
                items = WorkCodec.items_of(body)  # one item, or a chunk's
                for item in items:
                    self.seen.append(item)
                    self.seen_headers.append(dict(msg.headers or {}))
                    result = await self.handler(item, self)
                    if result is not None:  # None: never answered (a stuck or dying worker)
                        results.append(result)
                stuck = len(results) < len(items)  # its message is never acked
                if not self.together:
                    for result in results:
                        await self.nc.publish(
                            item.job.reply_subject, WorkCodec.results_message([result.to_msgpack()])
                        )
                    if not stuck:
                        await msg.ack()
                    continue
                subject = WorkCodec.routes(msg.headers)[0].results_subject
                answered.extend(
                    (msg if r is results[-1] and not stuck else None, subject, r) for r in results
                )
            for subject in {s for _, s, _ in answered if s is not None}:
                await self.nc.publish(
                    subject,
                    WorkCodec.results_message([r.to_msgpack() for _, s, r in answered if s == subject]),
                )
            for msg, _, _ in answered:
                if msg is not None:
                    await msg.ack()

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.heartbeat_s)
            with contextlib.suppress(Exception):
                await self.nc.publish(health_subject(self.worker_id), self.heartbeat())

    async def stop(self, *, tombstone: bool = True) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        if self.nc is not None and self.nc.is_connected:
            if tombstone:
                await self.nc.publish(health_subject(self.worker_id), self.heartbeat(terminated=True))
                await self.nc.flush()
            await self.nc.close()

    async def kill(self) -> None:
        """Die without a tombstone and without acking what it holds."""
        await self.stop(tombstone=False)
