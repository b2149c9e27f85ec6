"""The gateway's JetStream-backed stores, opened when it starts."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.batches import BatchStore
from gateway.pools import PoolStore
from gateway.result_cache import ResultCache


@dataclass
class Stores:
    """None until the gateway has opened it (the result cache and the batch store: or while off)."""

    pools: PoolStore | None = None
    cache: ResultCache | None = None
    batches: BatchStore | None = None  # the OpenAI Batch API's files and batches
