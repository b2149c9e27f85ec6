"""Settings of the config service (one object, read from ``SIE_*`` environment variables)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.nats_url import nats_servers

MAX_BODY_BYTES = 1024 * 1024
BODY_TIMEOUT_S = 30.0


class ConfigServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIE_", extra="ignore", populate_by_name=True)

    # Store. Default: SQLite file ``config.db`` under config_state_dir.
    config_db_url: str | None = (
        None  # SQLAlchemy URL (postgresql://... or sqlite:///...); default: SQLite under the state dir
    )
    config_state_dir: Path = Path("./.sie/config")  # directory of the default SQLite file and its writer lock
    # HTTP listener.
    config_host: str = "127.0.0.1"  # HTTP bind address
    config_port: int = Field(default=8090, ge=0, le=65535)  # HTTP port
    config_advertise_url: str | None = (
        None  # where other replicas reach this one (standbys forward writes to the writer's); default from POD_IP or the host
    )
    # NATS for deltas; empty disables publishing (writes are then accepted without deltas).
    nats_url: str | None = (
        "nats://127.0.0.1:4222"  # NATS for config deltas; empty turns publishing off (dev only)
    )
    nats_connect_timeout_s: float = Field(
        default=45.0, gt=0
    )  # limit of one NATS connect attempt (retried in the background)
    # Auth. None/empty = not configured.
    admin_token: str | None = None  # token for writes (also opens reads); gateway: pool and config writes
    config_read_token: str | None = None  # token for config reads including /export
    auth_token: str | None = None  # inference token; on the config service it opens reads except /export
    deployment_env: str | None = None  # prod/production: refuse to run open without tokens
    env: str | None = None  # same as SIE_DEPLOYMENT_ENV
    # Image-baked bundles and baseline models (``*.yaml``); both optional.
    bundles_dir: Path | None = None
    models_dir: Path | None = None
    # Publisher identity in deltas; POD_NAME (no prefix) in Kubernetes.
    pod_name: str | None = Field(
        default=None, validation_alias=AliasChoices("POD_NAME", "SIE_POD_NAME")
    )  # publisher identity (router_id) in deltas
    # Limits and timers.
    config_max_body_bytes: int = Field(default=MAX_BODY_BYTES, gt=0)  # largest POST body (413 above)
    config_body_timeout_s: float = Field(
        default=BODY_TIMEOUT_S, gt=0
    )  # the whole POST body must arrive within this (408 after)
    config_lock_poll_s: float = Field(
        default=1.0, gt=0
    )  # how often a standby replica tries for the writer lock
    config_idempotency_ttl_s: float = Field(
        default=86400.0, gt=0
    )  # how long Idempotency-Key answers are kept
    threshold_routing_enabled: bool = False  # allow routing.policy: threshold in model configs
    log_level: str = "INFO"  # logging level
    log_format: Literal["text", "json"] = (
        "text"  # log lines: text, or json (one object per line with request_id and trace_id)
    )

    def db_url(self) -> str:
        if self.config_db_url:
            return self.config_db_url
        return f"sqlite:///{(self.config_state_dir / 'config.db').resolve()}"

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str | None) -> str | None:
        if not value or not value.strip():
            return value  # publishing off (dev only)
        return ",".join(nats_servers(value))  # one server, or every member of a cluster

    def advertise_url(self) -> str:
        """The URL other replicas forward writes to: SIE_CONFIG_ADVERTISE_URL, else this replica's
        address (POD_IP in Kubernetes, the bind address unless it is a wildcard, else the host name)."""
        if self.config_advertise_url:
            return self.config_advertise_url.rstrip("/")
        host = os.environ.get("POD_IP") or (
            self.config_host if self.config_host not in ("", "0.0.0.0", "::") else socket.gethostname()
        )
        return f"http://{host}:{self.config_port}"

    def router_id(self) -> str:
        return self.pod_name or f"sie-config-{socket.gethostname()}-{os.getpid()}"

    def is_production(self) -> bool:
        return any(
            (v or "").strip().lower() in ("prod", "production") for v in (self.deployment_env, self.env)
        )
