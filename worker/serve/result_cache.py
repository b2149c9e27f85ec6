"""``sie serve``'s result cache: an in-process LRU of encoded items (opt-in, ``SIE_SERVE_RESULT_CACHE_ITEMS``).

Same key function as the gateway's shared cache (:func:`protocol.result_cache.result_key`, model
config hash included); per item: a request with some hits encodes only its misses. One process,
nothing shared, so it lives in memory and holds at most ``max_items`` entries, each for ``ttl_s``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from protocol.api import EncodeParams, Item
from protocol.params import check_items
from protocol.priority import INTERACTIVE
from protocol.result_cache import model_config_hash, result_key
from worker.runtime import Runtime
from worker.runtime.results import Result, Timing


class ResultLRU:
    def __init__(self, max_items: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        entry = self._entries.get(key)
        if entry is None or self.clock() - entry[0] > self.ttl_s:
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, key: str, value: Any) -> None:
        self._entries[key] = (self.clock(), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_items:
            self._entries.popitem(last=False)


async def encode_cached(
    runtime: Runtime,
    cache: ResultLRU,
    model: str,
    items: Sequence[Item],
    params: EncodeParams | None,
    *,
    priority: str = INTERACTIVE,
) -> tuple[Result, int]:
    """``runtime.encode`` of the items the cache does not hold; ``(result in request order, hits)``.
    Usage counts the tokens encoded now (hits cost none)."""
    t0 = time.monotonic()
    resolved = runtime.catalog.resolve(model, params.options if params else None)
    # item errors name the item's index in the whole request
    check_items(resolved, items, runtime.settings.max_item_text_bytes)
    config_hash = model_config_hash(resolved.config)
    rest = params.model_dump(exclude_none=True) if params else {}
    keys = [
        result_key({"operation": "encode", "model_id": resolved.model_id, "profile_id": resolved.profile_name,
                    "item": item.model_dump(exclude_none=True), "params": rest}, config_hash)
        for item in items
    ]  # fmt: skip
    out: list[Any] = [cache.get(k) for k in keys]
    todo = [i for i, found in enumerate(out) if found is None]
    if not todo:
        return Result(out, Timing(total_ms=(time.monotonic() - t0) * 1000), 0), len(items)
    fresh = await runtime.encode(model, [items[i] for i in todo], params, priority=priority)
    for i, value in zip(todo, fresh.items, strict=True):
        out[i] = value
        cache.put(keys[i], value)
    fresh.timing.total_ms = (time.monotonic() - t0) * 1000
    return Result(out, fresh.timing, fresh.input_tokens), len(items) - len(todo)
