"""Settings of the config service (one object, read from ``SIE_*`` environment variables)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_BODY_BYTES = 1024 * 1024


class ConfigServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIE_", extra="ignore", populate_by_name=True)

    # Store. Default: SQLite file ``config.db`` under config_state_dir.
    config_db_url: str | None = None
    config_state_dir: Path = Path("./.sie/config")
    # HTTP listener.
    config_host: str = "127.0.0.1"
    config_port: int = Field(default=8090, ge=0, le=65535)
    # NATS for deltas; empty disables publishing (writes are then accepted without deltas).
    nats_url: str | None = "nats://127.0.0.1:4222"
    nats_connect_timeout_s: float = Field(default=45.0, gt=0)
    # Auth (contract 8.1). None/empty = not configured.
    admin_token: str | None = None
    config_read_token: str | None = None
    auth_token: str | None = None
    deployment_env: str | None = None
    env: str | None = None
    # Image-baked bundles and baseline models (``*.yaml``); both optional.
    bundles_dir: Path | None = None
    models_dir: Path | None = None
    # Publisher identity in deltas; POD_NAME (no prefix) in Kubernetes.
    pod_name: str | None = Field(default=None, validation_alias=AliasChoices("POD_NAME", "SIE_POD_NAME"))
    # Limits and timers.
    config_max_body_bytes: int = Field(default=MAX_BODY_BYTES, gt=0)
    config_lock_poll_s: float = Field(default=1.0, gt=0)
    config_idempotency_ttl_s: float = Field(default=86400.0, gt=0)
    threshold_routing_enabled: bool = False
    log_level: str = "INFO"

    def db_url(self) -> str:
        if self.config_db_url:
            return self.config_db_url
        return f"sqlite:///{(self.config_state_dir / 'config.db').resolve()}"

    def router_id(self) -> str:
        return self.pod_name or f"sie-config-{socket.gethostname()}-{os.getpid()}"

    def is_production(self) -> bool:
        return any(
            (v or "").strip().lower() in ("prod", "production") for v in (self.deployment_env, self.env)
        )
