"""Reading JetStream key-value buckets without leaving consumers behind on the server.

A bucket is read key by key through a consumer on its stream. nats-py lists a bucket's keys
(``KeyValue.keys``) through a watcher whose consumer it never deletes and gives no inactivity
threshold, so the server keeps each one for minutes: the gateway that listed its batch leases
every second and its pools every few seconds left about 45 consumers a minute on the NATS members,
240-260 held on every member at a time under the soak's load (each one assigned through the
JetStream meta group), and the members' memory grew with them.

- :func:`bucket_keys` lists the keys once, through a consumer the server drops a few seconds after
  the listing ends: for reads that must see the bucket as it is now (the API's lists, a pool's
  admission count).
- :class:`KeyValueMirror` keeps every key's latest entry in memory through one long-lived watcher:
  for a loop that would otherwise list the bucket again and again (the batch runner's claims).
  What it holds is a moment behind the bucket, so a write decided from it must compare-and-set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

log = logging.getLogger(__name__)

LISTING_IDLE_S = 5.0  # the server drops a listing's consumer this long after the listing ended
MIRROR_IDLE_S = 30.0  # ... and a mirror's watcher this long after its gateway went away
MIRROR_RETRY_S = 1.0  # a watcher that failed is made again after this long


async def bucket_keys(kv: KeyValue) -> list[str]:
    """Every key that holds a value now (deleted and purged keys left out), in stream order."""
    watcher = await kv.watchall(ignore_deletes=True, meta_only=True, inactive_threshold=LISTING_IDLE_S)
    keys: list[str] = []
    try:
        async for entry in watcher:
            if entry is None:  # the end of what the bucket held when the watcher started
                break
            keys.append(entry.key)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
    return keys


class KeyValueMirror:
    """Every live key of ``kv`` with its latest entry (value and revision), kept by :meth:`run`."""

    def __init__(self, kv: KeyValue, name: str) -> None:
        self.kv, self.name = kv, name
        self.entries: dict[str, KeyValue.Entry] = {}
        self.loaded = asyncio.Event()  # set once the bucket's contents at the start are in

    async def run(self) -> None:
        """Until cancelled: watch the bucket, making the watcher again when it fails. nats-py's
        watcher makes its consumer again by itself when its heartbeats stop (the NATS member
        holding it died) and resumes after the last entry it saw."""
        while True:
            watcher = None
            try:
                watcher = await self.kv.watchall(inactive_threshold=MIRROR_IDLE_S)
                loading: dict[str, KeyValue.Entry] | None = {}
                async for entry in watcher:
                    if entry is None:
                        if loading is not None:
                            self.entries, loading = loading, None
                            self.loaded.set()
                        continue
                    table = self.entries if loading is None else loading
                    if entry.operation in (KV_DEL, KV_PURGE):
                        table.pop(entry.key, None)
                    else:
                        table[entry.key] = entry
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a watcher that could not be made (no leader, no connection)
                log.warning("watching bucket %s failed, again in %.0f s: %s", self.name, MIRROR_RETRY_S, exc)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]
            await asyncio.sleep(MIRROR_RETRY_S)
