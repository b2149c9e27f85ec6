"""JetStream stream and consumer settings shared by the gateway and the sidecar.

Both the gateway and the sidecar ensure the pool work stream; they must ask for identical settings,
so both build them here. Returned as plain dicts of nats-py keyword arguments (protocol stays free of
nats imports): ``StreamConfig(**stream_config(pool))`` / ``ConsumerConfig(**lane_consumer_config(...))``.
Durations are in seconds (nats-py converts them to nanoseconds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from protocol.subjects import (
    DLQ_PREFIX,
    DLQ_STREAM,
    INTERACTIVE,
    lane_durable,
    lane_filter,
    pool_stream_name,
    pool_stream_subjects,
)

# The JetStream object store that holds request payloads too large for a work message (iokit.payloads).
PAYLOADS_BUCKET = "SIE_PAYLOADS"

STREAM_STORAGES = ("file", "memory")

DEFAULT_STREAM_STORAGE = "file"
DEFAULT_STREAM_MAX_AGE_S = 1800.0
DEFAULT_STREAM_MAX_MSGS = 100_000
DEFAULT_STREAM_REPLICAS = 1
# Nats-Msg-Id = work_item_id dedupe window: a publish retried within it cannot enqueue an item twice.
DEFAULT_DUPLICATE_WINDOW_S = 120.0

# Short on purpose: a sidecar progress-ACKs what it holds every ack_wait/3 while a batch or a model
# load runs, so only a dead sidecar's items wait out the ack wait, and they are redelivered in seconds.
DEFAULT_ACK_WAIT_S = 3.0
DEFAULT_MAX_DELIVER = 20
DEFAULT_MAX_ACK_PENDING = 1000

DLQ_MAX_AGE_S = 24 * 3600.0
DLQ_DUPLICATE_WINDOW_S = 120.0


def _storage(storage: str) -> str:
    value = (storage or DEFAULT_STREAM_STORAGE).strip().lower()
    if value not in STREAM_STORAGES:
        raise ValueError(f"stream storage must be one of {STREAM_STORAGES}, got {storage!r}")
    return value


def stream_config(
    pool: str,
    *,
    storage: str = DEFAULT_STREAM_STORAGE,
    max_age_s: float = DEFAULT_STREAM_MAX_AGE_S,
    max_msgs: int = DEFAULT_STREAM_MAX_MSGS,
    replicas: int = DEFAULT_STREAM_REPLICAS,
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S,
) -> dict[str, Any]:
    """StreamConfig kwargs of the pool work stream ``WORK_POOL_{pool}`` on ``sie.work.{pool}.*.*.*``.

    WorkQueue retention, discard New (publish rejected at the cap instead of dropping old work).
    ``max_age_s`` must exceed max_deliver x ack_wait so a message can still be inspected after it
    trips the DLQ.
    """
    return {
        "name": pool_stream_name(pool),
        "subjects": pool_stream_subjects(pool),
        "retention": "workqueue",
        "storage": _storage(storage),
        "max_age": float(max_age_s),
        "max_msgs": int(max_msgs),
        "discard": "new",
        "num_replicas": int(replicas),
        "duplicate_window": float(duplicate_window_s),
    }


# Fields of the work stream compared when reconciling an existing stream in place (storage cannot
# change in place). Contract fields are the same for everyone; limit fields are operator settings
# that only the gateway carries (SIE_STREAM_MAX_MSGS and friends), so only the gateway reconciles them.
CONTRACT_STREAM_FIELDS = ("subjects", "discard")
LIMIT_STREAM_FIELDS = ("max_age", "max_msgs", "num_replicas")
RECONCILED_STREAM_FIELDS = CONTRACT_STREAM_FIELDS + LIMIT_STREAM_FIELDS


@dataclass(frozen=True)
class StreamPlan:
    """What to do about a work stream: ``create`` it, ``update`` it with ``config``, or ``keep`` it."""

    action: Literal["create", "update", "keep"]
    config: dict[str, Any]
    changed: tuple[str, ...] = ()
    storage_mismatch: tuple[str, str] | None = None  # (current, wanted) when they differ


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # nats-py enums → their wire strings


def stream_fields(config: Any) -> dict[str, Any]:
    """The storage and reconciled fields of a stream config (an object with attributes, or a map)."""
    names = ("storage", *RECONCILED_STREAM_FIELDS)
    if isinstance(config, Mapping):
        return {name: _plain(config.get(name)) for name in names}
    return {name: _plain(getattr(config, name, None)) for name in names}


def reconcile_stream(
    current: Mapping[str, Any] | None,
    desired: Mapping[str, Any],
    *,
    fields: Sequence[str] = RECONCILED_STREAM_FIELDS,
) -> StreamPlan:
    """Decide how to bring an existing stream (``current``, see :func:`stream_fields`) to ``desired``.

    Only ``fields`` are compared; an update sends ``desired`` for those fields and keeps every other
    reconciled field, and the storage, as they are on the server (storage cannot change in place).
    """
    wanted = dict(desired)
    if current is None:
        return StreamPlan("create", wanted)
    have = dict(current)
    mismatch = None
    if have.get("storage") is not None and _plain(have["storage"]) != _plain(wanted.get("storage")):
        mismatch = (str(_plain(have["storage"])), str(_plain(wanted.get("storage"))))
    changed = tuple(f for f in fields if _plain(have.get(f)) != _plain(wanted.get(f)))
    if not changed:
        return StreamPlan("keep", wanted, (), mismatch)
    update = dict(wanted)
    for name in RECONCILED_STREAM_FIELDS:
        if name not in fields and have.get(name) is not None:
            update[name] = have[name]
    if have.get("storage") is not None:
        update["storage"] = _plain(have["storage"])
    return StreamPlan("update", update, changed, mismatch)


def lane_consumer_config(
    pool: str,
    machine_profile: str,
    bundle: str,
    *,
    priority: str = INTERACTIVE,
    ack_wait_s: float = DEFAULT_ACK_WAIT_S,
    max_deliver: int = DEFAULT_MAX_DELIVER,
    max_ack_pending: int = DEFAULT_MAX_ACK_PENDING,
) -> dict[str, Any]:
    """ConsumerConfig kwargs of a lane durable (shared by a lane's pods): ``{pool}_{profile}_{bundle}``
    for interactive work, ``…_bulk`` for bulk work."""
    durable = lane_durable(pool, machine_profile, bundle, priority)
    return {
        "durable_name": durable,
        "name": durable,
        "filter_subject": lane_filter(pool, machine_profile, bundle, priority),
        "ack_policy": "explicit",
        "deliver_policy": "all",
        "ack_wait": float(ack_wait_s),
        "max_deliver": int(max_deliver),
        "max_ack_pending": int(max_ack_pending),
    }


def dlq_stream_config(
    *, storage: str = DEFAULT_STREAM_STORAGE, replicas: int = DEFAULT_STREAM_REPLICAS
) -> dict[str, Any]:
    """StreamConfig kwargs of ``DEAD_LETTERS`` (subjects ``sie.dlq.>``, Limits retention, 24 h)."""
    return {
        "name": DLQ_STREAM,
        "subjects": [f"{DLQ_PREFIX}.>"],
        "retention": "limits",
        "storage": _storage(storage),
        "max_age": DLQ_MAX_AGE_S,
        "discard": "old",
        "num_replicas": int(replicas),
        "duplicate_window": DLQ_DUPLICATE_WINDOW_S,
    }
