"""The result cache shared by every gateway: a JetStream key-value bucket of finished item results.

Keys come from :func:`protocol.result_cache.work_item_key` (content-addressed, model config hash
included). The bucket holds one value per key; its TTL is the bucket's max age and its size bound
the bucket's max bytes, with the oldest entries dropped first when it is full (a cache, unlike the
key-value default that refuses new writes). Every replica opens the same bucket, so a result one
gateway stored is a hit on all of them. The cache never fails a request: an unreachable bucket is
a miss, a failed write is counted and forgotten.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from gateway.metrics import GatewayMetrics
from protocol.result_cache import CachedAnswer, pack_entry, unpack_entry
from protocol.work import WorkResult

log = logging.getLogger(__name__)

CACHE_WORKER_ID = "result-cache"  # worker_id of a result answered from the cache
_CONCURRENCY = 64  # key-value reads or writes in flight per request


class ResultCache:
    def __init__(
        self, kv: KeyValue, metrics: GatewayMetrics, *, max_value_bytes: int, timeout_s: float
    ) -> None:
        self.kv = kv
        self.metrics = metrics
        self.max_value_bytes = max_value_bytes
        self.timeout_s = timeout_s
        self._sem = asyncio.Semaphore(_CONCURRENCY)

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str,
        metrics: GatewayMetrics,
        *,
        ttl_s: float,
        max_bytes: int,
        max_value_bytes: int,
        storage: str = "file",
        replicas: int = 1,
        timeout_s: float = 1.0,
    ) -> ResultCache:
        """Open (or create) the bucket and bring its TTL, size bound and discard policy to the settings."""
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = KeyValueConfig(
                bucket=bucket,
                history=1,
                ttl=ttl_s,
                max_bytes=max_bytes,
                max_value_size=max_value_bytes,
                storage=StorageType.FILE if storage == "file" else StorageType.MEMORY,
                replicas=replicas,
                direct=True,
            )
            try:
                kv = await js.create_key_value(config)
            except nats.js.errors.BadRequestError:
                kv = await js.key_value(bucket)  # created concurrently by another replica
        await cls._reconcile(js, bucket, ttl_s=ttl_s, max_bytes=max_bytes, max_value_bytes=max_value_bytes)
        return cls(kv, metrics, max_value_bytes=max_value_bytes, timeout_s=timeout_s)

    @staticmethod
    async def _reconcile(
        js: JetStreamContext, bucket: str, *, ttl_s: float, max_bytes: int, max_value_bytes: int
    ) -> None:
        name = f"KV_{bucket}"
        info = await js.stream_info(name)
        cfg = info.config
        wanted = {
            "max_age": float(ttl_s),
            "max_bytes": int(max_bytes),
            "max_msg_size": int(max_value_bytes),
            "discard": DiscardPolicy.OLD,
        }
        if all(getattr(cfg, k) == v for k, v in wanted.items()):
            return
        for k, v in wanted.items():
            setattr(cfg, k, v)
        try:
            await js.update_stream(cfg)
        except nats.js.errors.APIError as exc:
            log.warning("could not reconcile result cache bucket %s: %s", bucket, exc)

    async def lookup(self, keys: list[str | None]) -> list[CachedAnswer | None]:
        """The stored entry of each key (``None``: a miss, or no key)."""

        async def one(key: str | None) -> CachedAnswer | None:
            if key is None:
                return None
            async with self._sem:
                try:
                    entry = await asyncio.wait_for(self.kv.get(key), self.timeout_s)
                except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                    return None
                except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
                    self.metrics.cache_errors.labels("read").inc()
                    log.debug("result cache read failed: %s", exc)
                    return None
            return unpack_entry(entry.value) if entry.value else None

        found = await asyncio.gather(*(one(k) for k in keys))
        hits = sum(1 for f in found if f is not None)
        self.metrics.cache_lookups.labels("hit").inc(hits)
        self.metrics.cache_lookups.labels("miss").inc(sum(1 for k in keys if k is not None) - hits)
        return list(found)

    async def store(self, entries: list[tuple[str, WorkResult]]) -> None:
        """Write the successful results (waits for the acks, bounded by the cache timeout)."""

        async def one(key: str, result: WorkResult) -> None:
            blob = pack_entry(
                CachedAnswer(
                    bytes(result.result_msgpack or b""),
                    result.input_tokens,
                    result.truncated_items,
                    result.dropped_tokens,
                )
            )
            if len(blob) > self.max_value_bytes:
                self.metrics.cache_errors.labels("too_large").inc()
                return
            async with self._sem:
                try:
                    await asyncio.wait_for(self.kv.put(key, blob), self.timeout_s)
                    self.metrics.cache_stores.inc()
                except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
                    self.metrics.cache_errors.labels("write").inc()
                    log.debug("result cache write failed: %s", exc)

        todo = [(k, r) for k, r in entries if r.success and r.result_msgpack]
        if todo:
            await asyncio.gather(*(one(k, r) for k, r in todo))


def cached_result(request_id: str, index: int, entry: CachedAnswer) -> WorkResult:
    """The WorkResult of a cache hit (no queue, no inference: its timings are zero)."""
    return WorkResult(
        work_item_id=f"{request_id}.{index}",
        request_id=request_id,
        item_index=index,
        success=True,
        result_msgpack=entry.result_msgpack,
        input_tokens=entry.input_tokens,
        truncated_items=entry.truncated_items,
        dropped_tokens=entry.dropped_tokens,
        worker_id=CACHE_WORKER_ID,
    )
