"""The gateway's one settings object, read from ``SIE_*`` environment variables."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.nats_url import nats_servers
from protocol.priority import priority_setting


def _csv(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple, set)):
        raise ValueError(f"expected a comma-separated string or a list, got {type(value).__name__}")
    return [str(v).strip() for v in value if str(v).strip()]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIE_", extra="ignore")

    # NATS and streams
    nats_url: str = (
        "nats://127.0.0.1:4222"  # NATS server the gateway publishes work to and reads heartbeats/deltas from
    )
    stream_storage: str = (
        "file"  # JetStream storage of the work streams it creates: file (survives a NATS restart) or memory
    )
    stream_max_age_s: float = 1800.0  # work items older than this are dropped from the stream
    stream_max_msgs: int = 100_000  # hard cap of messages per work stream
    stream_replicas: int = 1  # JetStream replicas of the streams it creates (3 on a clustered NATS)

    # HTTP
    gateway_host: str = "0.0.0.0"  # HTTP listen address
    gateway_port: int = 8080  # HTTP listen port
    gateway_reuse_port: bool = (
        False  # share the port with other gateway replicas (SO_REUSEPORT; sie up --gateways)
    )
    gateway_request_timeout_s: float = Field(
        default=120.0, gt=0
    )  # deadline for a request's results; then 504
    gateway_max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)  # larger request bodies get 413
    gateway_body_timeout_s: float = Field(
        default=30.0, gt=0
    )  # the whole request body must arrive within this (408 after)
    gateway_max_items: int = Field(default=4096, gt=0)  # most items per encode/extract request (400 above)
    gateway_max_score_items: int = Field(default=1000, gt=0)  # most documents per score request (400 above)
    gateway_rerank_default_model: str = (
        ""  # the model of a TEI-style POST /rerank that names none (400 when unset)
    )
    gateway_max_stream_pending: int = Field(
        default=50_000, gt=0
    )  # stream messages above which requests get 503 QUEUE_FULL
    gateway_publish_concurrency: int = Field(
        default=64, gt=0
    )  # a request's JetStream publishes waiting for their acks at once
    gateway_work_chunk_items: int = Field(
        default=32, gt=0, le=256
    )  # most items of one request in one work message (fewer when several pods share the lane); 1: one message per item
    gateway_drain_timeout_s: float = Field(
        default=20.0, ge=0
    )  # on SIGTERM: new requests get 503 QUEUE_UNAVAILABLE + Retry-After while those in flight finish, for at most this long (keep it under the pod's terminationGracePeriodSeconds minus preStopSleepSeconds)
    gateway_publish_timeout_s: float = Field(
        default=6.0, gt=0
    )  # wait for all publish acks of a request before giving up
    gateway_direct_after_s: float = Field(
        default=1.0, ge=0
    )  # with replicated streams: a request without a result this long makes the gateway ask whether its lane's stream and durable have leaders; while either has none, the lane's work goes to its sidecars on core NATS (docs/ha.md); 0: never
    gateway_provisioning_retry_after_s: float = Field(
        default=10.0, ge=0
    )  # Retry-After of PROVISIONING (scale from zero) answers
    gateway_queue_full_retry_after_s: float = Field(default=1.0, ge=0)  # Retry-After of QUEUE_FULL answers
    gateway_configured_gpus: Annotated[list[str], NoDecode] = Field(
        default_factory=list
    )  # CSV of machine profiles this cluster can provision (empty: any)
    gateway_worker_stale_s: float = Field(default=15.0, gt=0)  # a worker silent this long is unhealthy
    gateway_worker_warmup_s: float = Field(
        default=6.0, ge=0
    )  # /readyz waits this long after subscribing to heartbeats (one heartbeat interval), so a new replica knows the live workers
    gateway_demand_expiry_s: float = Field(
        default=120.0, gt=0
    )  # pending demand of a lane is forgotten after this

    # Result cache (a JetStream key-value bucket shared by every gateway)
    # off by default: a miss costs a key-value read and write per item (a third of the zero-cost path)
    result_cache_enabled: bool = (
        False  # answer repeated items from the shared cache (opt-out per request: X-SIE-Cache: off)
    )
    result_cache_bucket: str = "SIE_RESULTS"  # key-value bucket of cached results
    result_cache_ttl_s: float = Field(
        default=3600.0, gt=0
    )  # a cached result expires this long after it was stored
    result_cache_max_bytes: int = Field(
        default=256 * 1024 * 1024, gt=0
    )  # size bound of the bucket; the oldest entries go first
    result_cache_max_value_bytes: int = Field(default=1024 * 1024, gt=0)  # larger results are not cached
    result_cache_timeout_s: float = Field(
        default=1.0, gt=0
    )  # a cache read or write slower than this counts as a miss

    # OpenAI Batch API (files and batches in JetStream: an object store and two key-value buckets)
    batch_enabled: bool = True  # serve /v1/files and /v1/batches, and run batches on this gateway
    batch_max_file_bytes: int = Field(
        default=100 * 1024 * 1024, gt=0
    )  # largest file POST /v1/files takes (413 beyond)
    batch_max_lines: int = Field(default=50_000, gt=0)  # most request lines one batch file may hold
    batch_lines_in_flight: int = Field(
        default=16, gt=0
    )  # lines of one batch a gateway runs at a time (each a request at bulk priority)
    batch_chunk_lines: int = Field(
        default=200, gt=0
    )  # lines between two progress records: a gateway that dies loses at most this much work
    batch_lease_s: float = Field(
        default=15.0, gt=0
    )  # a batch whose gateway stopped renewing its lease this long ago is taken over by another

    # Priority classes
    gateway_default_priority: str = (
        "interactive"  # priority of requests without X-SIE-Priority, a token or a pool default
    )
    gateway_bulk_share: float = Field(
        default=0.9, gt=0, le=1
    )  # bulk requests are refused (QUEUE_FULL) above this share of gateway_max_stream_pending

    # Auth
    auth_mode: str = "none"  # none, or token/static: bearer tokens required on inference routes
    auth_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list
    )  # CSV of accepted inference tokens
    auth_token: str | None = None  # one more accepted inference token
    auth_bulk_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list
    )  # CSV of accepted inference tokens whose requests default to the bulk priority class
    admin_token: str | None = (
        None  # token required for pool and config writes (POST/PUT/DELETE), in every auth mode (none included); unset: those routes answer 403
    )
    auth_exempt_operational: bool = False  # true: /, /health and /metrics answer without a token

    # Pools
    pool_ttl_s: float = Field(
        default=1200.0, gt=0
    )  # default pool lease; a pool not renewed for this long expires
    pool_max_ttl_s: float = Field(default=3600.0, gt=0)  # largest ttl_seconds a pool may ask for
    pool_max_count: int = Field(default=64, gt=0)  # most pools at once
    pool_bucket: str = (
        "SIE_POOLS"  # JetStream key-value bucket holding the pools (shared by gateway replicas)
    )
    pool_sweep_interval_s: float = Field(default=30.0, gt=0)  # how often expired pools are removed
    pool_pin_interval_s: float = Field(
        default=5.0, gt=0
    )  # how often each worker is told the pinned_models of the pools it is assigned to

    # Model registry source: the config service when its URL is set, else the catalog directories
    config_service_url: str | None = (
        None  # config service base URL, or its replicas' URLs comma-separated (read from the next one when one cannot be reached); set: bootstrap + deltas + epoch poll, /readyz 503 until the first export
    )
    config_service_token: str | None = (
        None  # bearer token for the config service's read routes (its SIE_CONFIG_READ_TOKEN)
    )
    config_poll_interval_s: float = Field(
        default=30.0, gt=0
    )  # epoch poll period; drift (higher or lower epoch) re-exports
    config_http_timeout_s: float = Field(default=10.0, gt=0)  # timeout of one call to the config service
    config_bootstrap_backoff_max_s: float = Field(
        default=60.0, gt=0
    )  # longest wait between failed bootstrap attempts (from 1 s, doubling)
    models_dir: str = "worker/catalog/models"  # model YAML directory, used without a config service
    bundles_dir: str = "worker/catalog/bundles"  # bundle YAML directory, used without a config service
    log_level: str = "INFO"  # logging level
    log_format: Literal["text", "json"] = (
        "text"  # log lines: text, or json (one object per line with request_id and trace_id)
    )

    @field_validator(
        "gateway_configured_gpus",
        "auth_tokens",
        "auth_bulk_tokens",
        mode="before",
    )
    @classmethod
    def _split_csv(cls, value: object) -> list[str]:
        return _csv(value)

    @field_validator("auth_mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        value = (value or "none").strip().lower()
        if value not in ("none", "token", "static"):
            raise ValueError("SIE_AUTH_MODE must be none, token or static")
        return value

    @field_validator("gateway_default_priority")
    @classmethod
    def _priority(cls, value: str) -> str:
        return priority_setting(value, "SIE_GATEWAY_DEFAULT_PRIORITY")

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str) -> str:
        return ",".join(nats_servers(value))  # one server, or every member of a cluster

    @field_validator("stream_storage")
    @classmethod
    def _storage(cls, value: str) -> str:
        value = (value or "file").strip().lower()
        if value not in ("file", "memory"):
            raise ValueError("SIE_STREAM_STORAGE must be file or memory")
        return value

    @property
    def auth_enabled(self) -> bool:
        return self.auth_mode in ("token", "static")

    def inference_tokens(self) -> list[str]:
        tokens = list(self.auth_tokens)
        if self.auth_token:
            tokens.append(self.auth_token)
        tokens.extend(self.auth_bulk_tokens)
        return tokens

    def configured_gpus(self) -> list[str]:
        return [g.lower() for g in self.gateway_configured_gpus]
