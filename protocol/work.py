"""Work result and heartbeat schemas (a job and its messages: protocol.jobs, protocol.work_codec).

On the wire each is a msgpack map (heartbeats: JSON) with named keys; unknown keys are ignored and
missing optional keys take their defaults, so either side can add fields without breaking the other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from protocol.codec import packb, unpackb, unpackb_plain
from protocol.jobs import ItemIds
from protocol.records import record

T = TypeVar("T")


def _from_map(cls: type[T], data: dict[str, Any]) -> T:
    names = _names(cls)
    if names.issuperset(data):  # what our own producers send: no unknown key to drop
        return cls(**data)
    return cls(**{k: v for k, v in data.items() if k in names})


_NAMES: dict[type, frozenset[str]] = {}


def _names(cls: type) -> frozenset[str]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = frozenset(f.name for f in fields(cls))
    return names


@dataclass
class WorkResult:
    work_item_id: str
    request_id: str
    item_index: int
    success: bool
    result_msgpack: bytes | None = None
    error: str | None = None
    error_code: str | None = None
    inference_ms: float = 0.0
    queue_ms: float = 0.0
    processing_ms: float = 0.0
    tokenization_ms: float = 0.0
    postprocessing_ms: float = 0.0
    payload_fetch_ms: float = 0.0
    worker_id: str = ""
    retry_after_s: float | None = None
    input_tokens: int | None = None
    error_extra: dict[str, Any] | None = None
    #: truncation totals of the item (score: of its whole request): items cut, tokens cut off
    truncated_items: int = 0
    dropped_tokens: int = 0
    #: the result's bytes are in the payload store under this name (iokit.payloads): it was
    #: larger than the NATS max payload
    result_ref: str | None = None

    def to_msgpack(self) -> bytes:
        return packb({k: v for k, v in self.__dict__.items() if v is not None})

    @classmethod
    def from_msgpack(cls, data: bytes) -> WorkResult:
        """A result from its bytes, its fields' types checked (ValueError: not a result)."""
        return record(cls, unpackb_plain(data))

    @classmethod
    def failure(
        cls,
        item: ItemIds,
        code: str,
        message: str,
        *,
        retry_after_s: float | None = None,
        extra: dict[str, Any] | None = None,
        worker_id: str = "",
    ) -> WorkResult:
        """The error result of ``item``: every producer of one (worker, sidecar) builds it here."""
        return cls(
            work_item_id=item.work_item_id,
            request_id=item.request_id,
            item_index=item.item_index,
            success=False,
            error=message,
            error_code=str(code),
            retry_after_s=retry_after_s,
            error_extra=dict(extra) if extra else None,
            worker_id=worker_id,
        )


@dataclass
class Heartbeat:
    name: str
    ready: bool
    machine_profile: str
    pool_name: str
    bundle: str
    terminated: bool = False
    gpu_count: int = 1
    total_gpu_slots: int = 1
    ready_gpu_slots: int = 1
    bundle_config_hash: str = ""
    loaded_models: list[str] = field(default_factory=list)
    queue_depth: int = 0
    pending_cost: int = 0
    inflight_batches: int = 0
    saturated: bool = False
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    unsupported_models: list[str] = field(default_factory=list)
    timestamp: float = 0.0
    # routable name (M or M:P) → loaded | loading | failed, for profiles with an instance
    model_states: dict[str, str] = field(default_factory=dict)
    # routable name → the message of its last failed load on this worker
    failed_models: dict[str, str] = field(default_factory=dict)
    # model id → where its weights are for this worker (protocol.weights)
    weights: dict[str, str] = field(default_factory=dict)
    # model ids kept loaded on this worker (SIE_PINNED_MODELS and its pools' pinned_models)
    pinned_models: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        data = asdict(self)
        for key in ("unsupported_models", "model_states", "failed_models", "weights", "pinned_models"):
            if not data[key]:
                del data[key]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> Heartbeat:
        """Accepts JSON (what we publish) or msgpack."""
        try:
            decoded = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            decoded = unpackb(data)
        if not isinstance(decoded, dict):
            raise ValueError("heartbeat must be a map")
        return _from_map(cls, decoded)
