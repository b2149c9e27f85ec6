"""IPC between the sidecar and the worker over a Unix domain socket.

Framing: ``[4-byte big-endian unsigned length][msgpack map]``, at most ``MAX_FRAME_BYTES`` per frame;
a clean EOF between frames ends the connection. Envelopes:

* request  ``{version, method, request_id, body}`` (+ optional ``traceparent``, see protocol.tracing)
* response ``{version, request_id, ok, body, error}`` (``ok=false`` is a logical error: no retry/reconnect)

One connection multiplexes concurrent calls: the client picks ``request_id`` and the server answers
each request when it is done, in any order.

The method bodies are plain msgpack maps with named keys; unknown keys are ignored and missing optional
keys take defaults, like every other schema in ``protocol``.

RunBatch carries bytes both ways, so nothing on the hot path is encoded or decoded twice: each item
is its input as the gateway encoded it and each job's bytes travel once (protocol.work_codec; the
worker decodes them once), and each ItemOutcome carries the WorkResult already encoded (``result``)
that the sidecar publishes to the reply inbox as is, beside what the sidecar needs to settle the
delivery (``work_item_id``, ``disposition``, ``error_code``, ``nak_delay_ms``) and the item's token
count (``input_tokens``), from which the sidecar learns to predict tokens for its batch costs.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from protocol.codec import CodecError, packb, unpackb
from protocol.errors import RETRYABLE_CODES
from protocol.subjects import INTERACTIVE
from protocol.work import WorkResult, _from_map

IPC_VERSION = 1
MAX_FRAME_BYTES = 32 * 1024 * 1024
FRAME_HEADER = struct.Struct(">I")

# Methods
PING = "Ping"
ENSURE_MODEL_READY = "EnsureModelReady"
RUN_BATCH = "RunBatch"
DRAIN = "Drain"
APPLY_MODEL_CONFIG = "ApplyModelConfig"
REPLACE_MODEL_CONFIGS = "ReplaceModelConfigs"
METRICS = "Metrics"  # answer {"text": <Prometheus text exposition of the worker's metrics>}
METHODS = (PING, ENSURE_MODEL_READY, RUN_BATCH, DRAIN, APPLY_MODEL_CONFIG, REPLACE_MODEL_CONFIGS, METRICS)

# EnsureModelReady states
STATE_READY = "ready"
STATE_LOADING_STARTED = "loading_started"
STATE_LOADING_IN_PROGRESS = "loading_in_progress"
STATE_RETRY_LATER = "retry_later"
STATE_FAILED = "failed"
ENSURE_STATES = (
    STATE_READY,
    STATE_LOADING_STARTED,
    STATE_LOADING_IN_PROGRESS,
    STATE_RETRY_LATER,
    STATE_FAILED,
)

# ItemOutcome dispositions
PUBLISH_AND_ACK = "publish_and_ack"
PUBLISH_ERROR_AND_ACK = "publish_error_and_ack"
NAK_RETRY = "nak_retry"
DEAD_LETTER = "dead_letter"  # the item's body is not a work item: no retry can fix it (``error`` says why)

# Error text of a batch method refused because the worker is draining.
DRAINING_ERROR = "draining"

# Codes of ``ok=false`` answers (the envelope's ``error_code``; ``error`` is text for people).
# EnsureModelReady's retry_later answer for a draining worker carries IPC_DRAINING as error_code too.
IPC_DRAINING = "DRAINING"  # the worker is draining: it takes no new batch
IPC_BAD_REQUEST = "BAD_REQUEST"  # malformed frame, envelope or body; unknown method; version mismatch
IPC_TOO_LARGE = "TOO_LARGE"  # a frame over the size cap
IPC_INTERNAL = "INTERNAL"  # the worker failed handling the call


class FrameError(ValueError):
    """A frame that breaks the framing rules (oversize length, truncated body, not a msgpack map)."""


class FrameTooLarge(FrameError):
    """The announced length exceeds the cap; the stream cannot be resynchronised."""


# --------------------------------------------------------------------------- framing


def encode_frame(obj: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    payload = packb(obj)
    if len(payload) > max_bytes:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the {max_bytes}-byte cap")
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    """The msgpack map of one frame body (FrameError if it is not one)."""
    if not payload:
        return {}
    try:
        obj = unpackb(payload)
    except CodecError as exc:
        raise FrameError(str(exc)) from exc
    if not isinstance(obj, dict):
        raise FrameError("frame body must be a msgpack map")
    return obj


# --------------------------------------------------------------------------- envelopes


def request_envelope(
    method: str, request_id: str, body: dict[str, Any] | None = None, *, traceparent: str | None = None
) -> dict[str, Any]:
    """``traceparent`` (optional, W3C): the caller's span, which the worker's spans continue."""
    envelope = {"version": IPC_VERSION, "method": method, "request_id": request_id, "body": body or {}}
    if traceparent:
        envelope["traceparent"] = traceparent
    return envelope


def response_envelope(
    request_id: str | None,
    *,
    ok: bool,
    body: dict[str, Any] | None = None,
    error: str | None = None,
    error_code: str | None = None,
) -> dict[str, Any]:
    return {
        "version": IPC_VERSION,
        "request_id": request_id,
        "ok": ok,
        "body": body,
        "error": error,
        "error_code": error_code,
    }


def error_envelope(request_id: str | None, code: str, error: str) -> dict[str, Any]:
    """An ``ok=false`` answer with its code (one of the ``IPC_*`` codes) and text."""
    return response_envelope(request_id, ok=False, error=error, error_code=code)


# --------------------------------------------------------------------------- method bodies


@dataclass
class PingResponse:
    timestamp_ms: int = 0
    worker_id: str = ""
    ready: bool = False
    bundle_config_hash: str = ""
    loaded_models: list[str] = field(default_factory=list)
    loading_models: list[str] = field(default_factory=list)
    # routable name (M or M:P) → loaded | loading | failed, for profiles with an instance
    model_states: dict[str, str] = field(default_factory=dict)
    # routable name → the message of its last failed load
    failed_models: dict[str, str] = field(default_factory=dict)
    # model id → where its weights are (protocol.weights), for the gateway's /v1/models
    weights: dict[str, str] = field(default_factory=dict)
    # models kept loaded (SIE_PINNED_MODELS and the pinned models of the pools the worker serves,
    # which the sidecar sends in each Ping as ``pinned_models``)
    pinned_models: list[str] = field(default_factory=list)

    def to_map(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_map(cls, data: dict[str, Any] | None) -> PingResponse:
        return _from_map(cls, data or {})


def forward_share(pending: int, idle_threads: int, most: int) -> int:
    """Items for the next batch of a model while ``idle_threads`` of its forward threads are idle: an
    equal share of the ``pending`` items for each (a lone request of 32 runs as two forwards of 16
    on two idle threads, not one of 32 on one), at most ``most``. The one rule of ``sie serve``'s
    BatchFormer and the sidecar's scheduler."""
    if idle_threads <= 1:
        return most
    return min(most, max(1, -(-pending // idle_threads)))


@dataclass
class EnsureModelReadyResponse:
    state: str
    max_batch_tokens: int | None = None
    batch_budget: int | None = None  # the model's max_batch_requests
    # batches the model's forward threads take at once (2 on CUDA, one per thread on CPU): the
    # sidecar keeps no more interactive batches than this on the worker, so waiting items join the
    # next batch instead of queueing there as many small ones
    forwards_in_flight: int | None = None
    # forwards of the model that run at once (its forward threads: SIE_FORWARD_THREADS on CPU, 1 on
    # CUDA): while one of them is idle the sidecar sends what is pending at once, spread over the idle
    # ones. The field keeps its first name on the wire.
    forward_lanes: int | None = None
    error: str | None = None
    error_code: str | None = None

    def to_map(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_map(cls, data: dict[str, Any] | None) -> EnsureModelReadyResponse:
        resp = _from_map(cls, data or {"state": STATE_RETRY_LATER})
        if resp.state not in ENSURE_STATES:
            resp.state = STATE_RETRY_LATER
        return resp


@dataclass
class RunBatchRequest:
    """One batch for the worker, formed by the sidecar (one model spec and one group key, see
    :attr:`protocol.jobs.Job.batch_key`); ``model_id`` names the batch in logs and ``worker_id`` is
    what the results say ran them. Its items travel as :class:`protocol.work_codec.WorkCodec`
    encodes them: each job once (``jobs``), each item's input (``items``) with the index of its job
    (``item_job``) and its id from its routing header (``item_ids``: an item whose input does not
    decode is still answered under its id)."""

    model_id: str  # model spec: "M" or "M:profile"
    item_ids: list[str]
    jobs: list[bytes]
    items: list[bytes]
    item_job: list[int]
    worker_id: str = ""
    # the class its items came in (protocol.subjects): on a CPU worker an interactive batch runs
    # inside a running bulk one, between two of its layers (worker/batching/preemption.py)
    priority: str = INTERACTIVE

    def to_map(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_map(cls, data: dict[str, Any]) -> RunBatchRequest:
        return _from_map(cls, data)


def disposition_for(success: bool, error_code: str | None) -> str:
    """How the sidecar settles an item: publish the result, publish the error, or NAK for retry.

    Retryable worker states (OOM after recovery, model loading/not loaded, queue full) are NAKed so
    the redelivery still has a chance; everything else is an answer for the client.
    """
    if success:
        return PUBLISH_AND_ACK
    if error_code in RETRYABLE_CODES:
        return NAK_RETRY
    return PUBLISH_ERROR_AND_ACK


@dataclass
class ItemOutcome:
    """How one item of a RunBatch came out. On the wire a map of the fields that are set, in this
    order (so equal outcomes encode to equal bytes)."""

    work_item_id: str
    disposition: str  # PUBLISH_AND_ACK | PUBLISH_ERROR_AND_ACK | NAK_RETRY | DEAD_LETTER
    error_code: str | None = None
    input_tokens: int | None = None  # the sidecar learns its cost estimate from it
    nak_delay_ms: int | None = None  # NAK_RETRY: when the redelivery is due
    result: bytes | None = None  # the encoded WorkResult, published as is (not for NAK_RETRY)
    error: str | None = None  # DEAD_LETTER: why the item is not a work item

    def to_map(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_map(cls, data: dict[str, Any]) -> ItemOutcome:
        return _from_map(cls, data)


def outcome_from_result(result: WorkResult) -> ItemOutcome:
    """The ItemOutcome of ``result``: the encoded result, and how the sidecar settles its delivery."""
    disposition = disposition_for(result.success, result.error_code)
    out = ItemOutcome(result.work_item_id, disposition, result.error_code, result.input_tokens)
    if disposition == NAK_RETRY:
        if result.retry_after_s is not None:
            out.nak_delay_ms = int(result.retry_after_s * 1000)
    else:
        out.result = result.to_msgpack()
    return out


def run_batch_response(outcomes: list[ItemOutcome]) -> dict[str, Any]:
    """RunBatch's answer body: ``{"outcomes": [outcome map, ...]}``."""
    return {"outcomes": [o.to_map() for o in outcomes]}


__all__ = [
    "APPLY_MODEL_CONFIG",
    "DRAIN",
    "DEAD_LETTER",
    "DRAINING_ERROR",
    "IPC_BAD_REQUEST",
    "IPC_DRAINING",
    "IPC_INTERNAL",
    "IPC_TOO_LARGE",
    "error_envelope",
    "ENSURE_MODEL_READY",
    "ENSURE_STATES",
    "EnsureModelReadyResponse",
    "FrameError",
    "FrameTooLarge",
    "IPC_VERSION",
    "ItemOutcome",
    "MAX_FRAME_BYTES",
    "METHODS",
    "NAK_RETRY",
    "PING",
    "PUBLISH_AND_ACK",
    "PUBLISH_ERROR_AND_ACK",
    "PingResponse",
    "REPLACE_MODEL_CONFIGS",
    "RUN_BATCH",
    "RunBatchRequest",
    "STATE_FAILED",
    "STATE_LOADING_IN_PROGRESS",
    "STATE_LOADING_STARTED",
    "STATE_READY",
    "STATE_RETRY_LATER",
    "decode_payload",
    "disposition_for",
    "encode_frame",
    "outcome_from_result",
    "request_envelope",
    "response_envelope",
    "run_batch_response",
]
