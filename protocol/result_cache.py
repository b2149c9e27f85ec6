"""The result cache's key: one content address per work item, shared by every front door.

A key names what a result depends on and nothing else: the operation, the model and profile, the
model's config (by hash, so a config change never serves an old result), and the item's content and
options (output types and dtype, instruction, query flag, LoRA, labels, ...). Per-request fields
(ids, reply subject, deadline, routing lane, priority) are left out, so two requests for the same
content share one entry. The gateway keys its JetStream key-value bucket with it, ``sie serve`` its
in-process LRU.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.codec import packb
from protocol.jobs import JobItem
from protocol.model_config import ModelConfig
from protocol.records import plain
from protocol.work_codec import input_map

KEY_VERSION = 2


def model_config_hash(config: ModelConfig) -> str:
    """SHA-256 of a model's whole config (every profile, weights, revision, options)."""
    blob = json.dumps(
        config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _canonical(value: Any) -> Any:
    """Maps with sorted keys, all the way down, so equal content packs to equal bytes."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value, key=lambda k: (type(k).__name__, str(k)))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def result_key(content: dict[str, Any], config_hash: str) -> str:
    """The cache key of one item: hex SHA-256 over the key version, the model config hash and the
    canonical msgpack of ``content`` (``None`` fields count as absent). ``content`` must name
    everything the result depends on: for ``sie serve`` the operation, model, profile, item and
    params (the gateway's job items: :func:`job_item_keys`)."""
    present = {k: v for k, v in content.items() if v is not None}
    digest = hashlib.sha256()
    digest.update(f"sie-result/{KEY_VERSION}/{config_hash}/".encode())
    digest.update(packb(_canonical(present)))
    return digest.hexdigest()


def job_item_keys(items: Sequence[JobItem], config_hash: str) -> list[str]:
    """The cache key of each job item: a digest of what its job decides (operation, model, profile,
    checked params; taken once per job) and of its input."""
    keys: list[str] = []
    jobs: dict[int, Any] = {}  # id of a job → the digest of its part
    for item in items:
        job = item.job
        base = jobs.get(id(job))
        if base is None:
            part = {"operation": job.operation, "model_id": job.model_id, "profile_id": job.profile_id,
                    "params": plain(job.content())}  # fmt: skip
            base = jobs[id(job)] = hashlib.sha256(f"sie-result/{KEY_VERSION}/{config_hash}/".encode())
            base.update(packb(_canonical(part)))
        digest = base.copy()
        digest.update(packb(_canonical(input_map(item.input))))
        keys.append(digest.hexdigest())
    return keys


@dataclass(frozen=True)
class CachedAnswer:
    """What the cache keeps of one successful item: the result bytes as the worker made them and
    the counts its answer reports (tokens, truncation)."""

    result_msgpack: bytes
    input_tokens: int | None = None
    truncated_items: int = 0
    dropped_tokens: int = 0


def pack_entry(answer: CachedAnswer) -> bytes:
    return packb(
        {
            "r": answer.result_msgpack,
            "t": answer.input_tokens,
            "ti": answer.truncated_items,
            "dt": answer.dropped_tokens,
        }
    )


def unpack_entry(blob: bytes) -> CachedAnswer | None:
    """The answer of a stored entry; ``None`` when it is not one of ours."""
    try:
        data = msgpack.unpackb(blob, raw=False)
    except Exception:  # noqa: BLE001 - a foreign or damaged entry is a miss
        return None
    if not isinstance(data, dict) or not isinstance(data.get("r"), bytes):
        return None

    def count(key: str) -> int | None:
        value = data.get(key)
        return value if isinstance(value, int) and value >= 0 else None

    return CachedAnswer(data["r"], count("t"), count("ti") or 0, count("dt") or 0)
