"""Bodies too large for one NATS message travel through a JetStream object store.

A work message whose body is over the server's max payload has it put into the ``SIE_PAYLOADS``
object store by the gateway and is published empty, with a header naming the object
(protocol.work_codec ``H_PAYLOAD``); the sidecar reads the object in its place before the item goes to the worker (the
routing header is in the message, so nothing else changes). A result over the max payload goes
the other way: the sidecar stores the result's bytes and publishes a small result that names them
(``WorkResult.result_ref``); the gateway reads and deletes the object. The bucket's max age is the
work streams' (an object left by a process that died goes with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType, StreamConsumerLimits
from nats.js.object_store import ObjectStore

from protocol.streams import PAYLOADS_BUCKET

log = logging.getLogger(__name__)

READER_IDLE_S = 5.0  # the server drops an object read's consumer this long after the read


async def drop_idle_readers(js: JetStreamContext, bucket: str, idle_s: float = READER_IDLE_S) -> None:
    """Have the server drop the consumers that read ``bucket``'s objects ``idle_s`` after a read.
    nats-py reads an object through an ordered consumer that it never deletes and gives no
    inactivity threshold, so each read left one on the server for minutes (a batch's end reads
    every chunk's output object). The bucket's stream makes ``idle_s`` its consumers' default
    (``consumer_limits``): an object store has no consumer of its own that must outlive a read.
    Best effort: the objects are read as before when the stream cannot be changed."""
    stream = f"OBJ_{bucket}"
    try:
        info = await js.stream_info(stream)
        config = info.config
        limits = config.consumer_limits
        if limits is not None and limits.inactive_threshold == idle_s:
            return
        config.consumer_limits = StreamConsumerLimits(inactive_threshold=idle_s)
        await js.update_stream(config)
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        log.warning("object reads of %s keep their consumers for minutes: %s", bucket, exc)


class PayloadReader(Protocol):
    async def get(self, name: str) -> bytes: ...


class PayloadStore:
    """The object store, opened (or created) on first use."""

    def __init__(
        self, js: JetStreamContext, *, storage: str = "file", replicas: int = 1, max_age_s: float = 1800.0
    ) -> None:
        self.js = js
        self.storage = storage
        self.replicas = replicas
        self.max_age_s = max_age_s
        self._store: ObjectStore | None = None
        self._lock = asyncio.Lock()

    async def bucket(self) -> ObjectStore:
        if self._store is None:
            async with self._lock:
                if self._store is None:
                    try:
                        self._store = await self.js.object_store(PAYLOADS_BUCKET)
                    except nats.js.errors.NotFoundError:
                        config = ObjectStoreConfig(
                            ttl=self.max_age_s,
                            storage=StorageType.FILE if self.storage == "file" else StorageType.MEMORY,
                            replicas=self.replicas,
                            description="work items and results over the max payload",
                        )
                        with contextlib.suppress(nats.js.errors.BadRequestError):  # made by another process
                            await self.js.create_object_store(PAYLOADS_BUCKET, config)
                        self._store = await self.js.object_store(PAYLOADS_BUCKET)
                    await drop_idle_readers(self.js, PAYLOADS_BUCKET)
        return self._store

    async def put(self, name: str, data: bytes) -> None:
        await (await self.bucket()).put(name, data)

    async def get(self, name: str) -> bytes:
        """The object's bytes; ``nats.js.errors.ObjectNotFoundError`` when there is none."""
        got = await (await self.bucket()).get(name)
        return got.data or b""

    async def delete(self, name: str) -> None:
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            await (await self.bucket()).delete(name)
