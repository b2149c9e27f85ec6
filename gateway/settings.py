"""The gateway's one settings object, read from ``SIE_*`` environment variables."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _csv(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v).strip() for v in value if str(v).strip()]  # type: ignore[union-attr]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIE_", extra="ignore")

    # NATS and streams
    nats_url: str = "nats://127.0.0.1:4222"
    stream_storage: str = "file"
    stream_max_age_s: float = 1800.0
    stream_max_msgs: int = 100_000
    stream_replicas: int = 1

    # HTTP
    gateway_host: str = "0.0.0.0"
    gateway_port: int = 8080
    gateway_request_timeout_s: float = Field(default=120.0, gt=0)
    gateway_max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    gateway_max_items: int = Field(default=4096, gt=0)
    gateway_max_score_items: int = Field(default=1000, gt=0)
    gateway_max_stream_pending: int = Field(default=50_000, gt=0)
    gateway_publish_concurrency: int = Field(default=64, gt=0)
    gateway_publish_timeout_s: float = Field(default=6.0, gt=0)
    gateway_provisioning_retry_after_s: float = Field(default=10.0, ge=0)
    gateway_queue_full_retry_after_s: float = Field(default=1.0, ge=0)
    gateway_configured_gpus: Annotated[list[str], NoDecode] = Field(default_factory=list)
    gateway_worker_stale_s: float = Field(default=15.0, gt=0)
    gateway_demand_expiry_s: float = Field(default=120.0, gt=0)

    # Auth
    auth_mode: str = "none"
    auth_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    auth_token: str | None = None
    admin_token: str | None = None
    auth_exempt_operational: bool = False

    # Pools
    pool_ttl_s: float = Field(default=1200.0, gt=0)
    pool_max_ttl_s: float = Field(default=3600.0, gt=0)
    pool_max_count: int = Field(default=64, gt=0)
    pool_bucket: str = "SIE_POOLS"
    pool_sweep_interval_s: float = Field(default=30.0, gt=0)

    # Model registry source (until the config service exists)
    models_dir: str = "worker/catalog/models"
    bundles_dir: str = "worker/catalog/bundles"

    @field_validator("gateway_configured_gpus", "auth_tokens", mode="before")
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
        return tokens

    def configured_gpus(self) -> list[str]:
        return [g.lower() for g in self.gateway_configured_gpus]
