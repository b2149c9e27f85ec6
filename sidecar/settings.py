"""The sidecar's one settings object, read from ``SIE_*`` environment variables."""

from __future__ import annotations

import socket

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    nats_url: str = "nats://127.0.0.1:4222"
    pool: str = "default"
    machine_profile: str = "cpu"
    bundle: str = "default"
    worker_id: str = Field(default_factory=socket.gethostname)
    # worker IPC
    ipc_socket_path: str = "/tmp/sie-ipc.sock"
    ipc_request_timeout_s: float = 60.0
    model_ready_timeout_s: float = 900.0
    worker_ping_interval_ms: int = 2000
    worker_readyz_stale_mult: int = 3
    # settlement
    nak_delay_s: float = 5.0
    oom_nak_delay_s: float = 10.0
    overflow_nak_delay_s: float = 0.1
    model_loading_recheck_s: float = 5.0
    # JetStream
    max_deliver: int = DEFAULT_MAX_DELIVER
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    max_ack_pending: int = DEFAULT_MAX_ACK_PENDING
    nats_fetch_budget: int = 64
    nats_fetch_timeout_s: float = 1.0
    max_held_messages: int = 256
    stream_max_age_s: float = DEFAULT_STREAM_MAX_AGE_S
    stream_storage: str = DEFAULT_STREAM_STORAGE
    stream_replicas: int = DEFAULT_STREAM_REPLICAS
    # heartbeats
    health_publish_interval_ms: int = 5000
    # batching
    max_concurrent_batches: int = 4
    batcher_max_batch_requests: int = 64
    batcher_max_batch_wait_ms: float = 15.0
    batcher_max_batch_cost: int = 0  # 0 = the model's max_batch_tokens from EnsureModelReady
    batcher_default_batch_cost: int = 16384
    # cancellation
    cancel_tombstone_ttl_s: float = 600.0
    # shutdown
    drain_timeout_s: float = 25.0
    log_level: str = "INFO"

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

    @field_validator("stream_storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        v = v.strip().lower()
        if v not in ("file", "memory"):
            raise ValueError("SIE_STREAM_STORAGE must be file or memory")
        return v

    @property
    def progress_interval_s(self) -> float:
        """Progress-ACK held messages this often (a third of ack_wait, at most 10 s)."""
        return max(0.5, min(10.0, self.ack_wait_s / 3))

    @property
    def loading_recheck_cap_s(self) -> float:
        return max(0.1, self.ack_wait_s / 2)
