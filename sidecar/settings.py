"""The sidecar's one settings object, read from ``SIE_*`` environment variables."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.batching import BatchLimits
from protocol.nats_url import nats_servers
from protocol.siblings import process_socket, process_worker_id
from protocol.streams import (
    DEFAULT_ACK_WAIT_S,
    DEFAULT_MAX_ACK_PENDING,
    DEFAULT_MAX_DELIVER,
    DEFAULT_STREAM_MAX_AGE_S,
    DEFAULT_STREAM_REPLICAS,
    DEFAULT_STREAM_STORAGE,
)
from protocol.subjects import lane_token, normalize_id


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIE_", extra="ignore")

    # identity / lane
    nats_url: str = (
        "nats://127.0.0.1:4222"  # NATS server (JetStream work stream, results, heartbeats, config deltas)
    )
    pool: str = (
        "default"  # pool of this worker pod: its lane and the pool its bundle_config_hash is scoped to
    )
    machine_profile: str = "cpu"  # machine profile of this pod (lane subject token, heartbeat)
    bundle: str = "default"  # bundle the worker serves: lane subject token and config deltas subscribed to
    worker_id: str = Field(
        default_factory=socket.gethostname
    )  # identity in heartbeats (sie.health.<id>) and results; default hostname
    # worker IPC
    ipc_socket_path: str = "/tmp/sie-ipc.sock"  # Unix socket of the worker's IPC server
    model_processes: int = Field(
        default=1, ge=1
    )  # worker processes in this pod (the worker's SIE_MODEL_PROCESSES, decided: the chart and sie up set both): one sidecar process each, process i on the worker's socket i, worker id <id>-p<i> and metrics port +i (protocol/siblings.py)
    process_index: int = Field(
        default=0, ge=0
    )  # set by the first sidecar process for the siblings it starts (0 = the first, which starts and restarts the others)
    ipc_request_timeout_s: float = (
        60.0  # limit of an ordinary IPC call (RunBatch: up to the items' deadlines)
    )
    model_ready_timeout_s: float = 900.0  # limit of one EnsureModelReady call
    worker_ping_interval_ms: int = 2000  # IPC Ping period
    worker_readyz_stale_mult: int = (
        3  # worker counts as gone after this many ping intervals without an answer
    )
    # settlement
    nak_delay_s: float = 5.0  # NAK delay for retryable failures (transport error, retry_later, no outcome)
    oom_nak_delay_s: float = 10.0  # NAK delay after RESOURCE_EXHAUSTED
    overflow_nak_delay_s: float = 0.1  # NAK delay when over the held budget, draining or shutting down
    model_loading_recheck_s: float = 5.0  # recheck a loading model this often (doubled while in progress)
    # JetStream
    max_deliver: int = DEFAULT_MAX_DELIVER  # deliveries per work item before JetStream gives up (DLQ)
    ack_wait_s: float = DEFAULT_ACK_WAIT_S  # JetStream ack wait of the lane consumer
    max_ack_pending: int = DEFAULT_MAX_ACK_PENDING  # unacknowledged messages the lane consumer may have out
    nats_fetch_budget: int = 64  # most messages per pull request
    nats_fetch_timeout_s: float = 1.0  # how long one pull request waits for messages
    max_held_messages: int = 256  # most deliveries held (queued or in flight) at once
    stream_max_age_s: float = (
        DEFAULT_STREAM_MAX_AGE_S  # max age of work in the stream when the sidecar creates it
    )
    stream_storage: str = (
        DEFAULT_STREAM_STORAGE  # file | memory storage of the stream when the sidecar creates it
    )
    stream_replicas: int = DEFAULT_STREAM_REPLICAS  # replicas of the stream when the sidecar creates it
    # heartbeats
    health_publish_interval_ms: int = 5000  # heartbeat period on sie.health.<worker_id>
    # batching
    max_concurrent_batches: int = 4  # batches on the worker at once (saturation = 90 % of this)
    batcher_max_batch_requests: int = 64  # most items per batch (capped by the model's batch budget)
    batcher_max_batch_wait_ms: float = 15.0  # longest wait for a batch to fill
    batcher_queued_full_batches: int = Field(
        default=2, ge=0
    )  # full interactive batches of a model sent to the worker beyond what its forwards take at once, to wait there for a forward (the worker is never idle between two batches while work is pending); a batch not full waits here for a forward instead
    batcher_gather_ms: float = Field(
        default=5.0, ge=0
    )  # an idle worker's next batch waits at most this long (from a request's first item) for the rest of the request's items still arriving, so it runs in one batch (the gateway counts them when one pod pulls the lane); 0 = no wait
    batcher_max_batch_cost: int = 0  # 0 = the model's max_batch_tokens from EnsureModelReady
    batcher_default_batch_cost: int = 16384  # batch cost cap when neither the setting nor the model gives one
    # priority classes (interactive work on the lane durable, bulk on the lane's ``_bulk`` durable)
    bulk_max_held_share: float = Field(
        default=0.75, gt=0, le=1
    )  # bulk deliveries fill at most this share of max_held_messages (the rest waits for interactive work)
    bulk_min_held_share: float = Field(
        default=0.125, ge=0, lt=1
    )  # interactive deliveries leave at least this share of max_held_messages to bulk
    bulk_max_concurrent_batches: int = Field(
        default=1, gt=0
    )  # bulk batches of one model on the worker at once (interactive batches do not wait behind more)
    bulk_max_batch_requests: int = Field(
        default=16, gt=0
    )  # most items per bulk batch (an interactive batch waits for at most one on the worker)
    bulk_mixed_batch_requests: int = Field(
        default=8, gt=0
    )  # most items per bulk batch while interactive work of the model is arriving
    bulk_mixed_window_s: float = Field(
        default=2.0, ge=0
    )  # interactive work seen this recently makes bulk batches the mixed size
    bulk_max_wait_ms: float = Field(
        default=2000.0, gt=0
    )  # a bulk batch waiting this long is scheduled like an interactive one
    # cancellation
    cancel_tombstone_ttl_s: float = 600.0  # how long a cancelled request id is remembered
    # config deltas and reconciliation
    config_service_url: str | None = (
        None  # config service base URL, or its replicas' URLs comma-separated (read from the next one when one cannot be reached); set: start-up export, epoch poll, periodic export
    )
    config_service_token: str | None = (
        None  # bearer token for the config service's read routes (export needs read or admin)
    )
    worker_config_poll_interval_ms: int = Field(default=30000, gt=0)  # config service epoch poll period
    worker_config_full_export_interval_ms: int = Field(
        default=300000, gt=0
    )  # full export period (also at start-up)
    # shutdown
    drain_timeout_s: float = 25.0  # how long shutdown waits for in-flight batches
    log_level: str = "INFO"  # logging level
    metrics_port: int = Field(
        default=0, ge=0, le=65535
    )  # port of the pod's GET /metrics (sidecar + worker over IPC); 0 = off
    metrics_host: str = "0.0.0.0"  # address the metrics port listens on
    log_format: Literal["text", "json"] = (
        "text"  # log lines: text, or json (one object per line with request_id and trace_id)
    )

    @field_validator("pool", "machine_profile", "bundle")
    @classmethod
    def _lane_token(cls, v: str) -> str:
        lane_token(v)  # raises on a value that cannot be a subject token
        return v

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, v: str) -> str:
        if not normalize_id(v.strip()):
            raise ValueError("SIE_WORKER_ID must not be empty")
        return v.strip()

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str) -> str:
        return ",".join(nats_servers(value))  # one server, or every member of a cluster

    @field_validator("stream_storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        v = v.strip().lower()
        if v not in ("file", "memory"):
            raise ValueError("SIE_STREAM_STORAGE must be file or memory")
        return v

    def for_process(self) -> SidecarSettings:
        """These settings as sidecar process ``process_index`` of the pod uses them: its worker's socket,
        its worker id and its metrics port."""
        i = self.process_index
        if i == 0:
            return self
        return self.model_copy(
            update={
                "ipc_socket_path": process_socket(self.ipc_socket_path, i),
                "worker_id": process_worker_id(self.worker_id, i),
                "metrics_port": self.metrics_port + i if self.metrics_port else 0,
            }
        )

    def batch_limits(self) -> BatchLimits:
        """The batching policy's limits for a model before EnsureModelReady tells its own (its
        max_batch_tokens and batch budget, sidecar.readiness)."""
        return BatchLimits(
            max_requests=self.batcher_max_batch_requests,
            max_cost=self.batcher_max_batch_cost or self.batcher_default_batch_cost,
            max_wait_s=self.batcher_max_batch_wait_ms / 1000.0,
            gather_s=self.batcher_gather_ms / 1000.0,
            queued_full_batches=self.batcher_queued_full_batches,
            bulk_max_requests=self.bulk_max_batch_requests,
            bulk_mixed_requests=self.bulk_mixed_batch_requests,
            bulk_mixed_window_s=self.bulk_mixed_window_s,
            bulk_max_wait_s=self.bulk_max_wait_ms / 1000.0,
            bulk_max_running=self.bulk_max_concurrent_batches,
        )

    @property
    def progress_interval_s(self) -> float:
        """Progress-ACK held messages this often (a third of ack_wait, at most 10 s)."""
        return max(0.5, min(10.0, self.ack_wait_s / 3))

    @property
    def loading_recheck_cap_s(self) -> float:
        return max(0.1, self.ack_wait_s / 2)
