"""ConfigNotification: the config delta the config service publishes on NATS,
plus the shapes of the config service's epoch and export answers that gateways and sidecars read.

Published as JSON to ``sie.config.models.{bundle}`` (one message per affected bundle) and the
same bytes to ``sie.config.models._all``. Gateways and sidecars decode it with
``decode_config_delta``; unknown keys are ignored and missing optional keys default, so older
and newer producers interoperate.

An empty ``model_config`` is a pure epoch bump: the receiver only advances its epoch (and
re-exports when it wants the full state). A *tombstone* (``deleted: true``, ``model_id`` set, no
``model_config``) removes the model: the receiver drops it from its catalog (a worker unloads it).
A replace (``PUT``) is an ordinary delta carrying the new full config.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Receivers refuse bigger deltas; the config service never publishes one.
MAX_CONFIG_DELTA_BYTES = 1024 * 1024


class ConfigDelta(BaseModel):
    """One config notification. ``router_id`` names the config pod that wrote it (logs only: a delta
    is trusted because only the config service's NATS user may publish its subject)."""

    # pydantic reserves the ``model_config`` attribute name, so the wire key ``model_config``
    # maps onto ``model_config_yaml``; populate_by_name lets code build it either way.
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, protected_namespaces=())

    router_id: str
    bundle_id: str
    epoch: int = Field(ge=0)
    bundle_config_hash: str = ""
    model_id: str = ""
    profiles_added: list[str] = Field(default_factory=list)
    # The full merged model config as YAML; "" = pure epoch bump.
    model_config_yaml: str = Field(default="", alias="model_config")
    affected_bundles: list[str] = Field(default_factory=list)
    # The model's pool, lower-cased; "default" when the model names none.
    pool: str = "default"
    bundle_pool_config_hashes: dict[str, dict[str, str]] = Field(default_factory=dict)
    bundle_adapters: dict[str, list[str]] = Field(default_factory=dict)
    # A tombstone: ``model_id`` was deleted (or no longer routes to this bundle).
    deleted: bool = False

    @property
    def is_epoch_bump(self) -> bool:
        return not self.model_config_yaml and not self.is_tombstone

    @property
    def is_tombstone(self) -> bool:
        return self.deleted and bool(self.model_id)

    def expected_hash(self, bundle: str | None = None, pool: str | None = None) -> str:
        """The hash a worker of ``bundle``/``pool`` must report after applying this delta."""
        bundle = bundle or self.bundle_id
        if pool is not None:
            scoped = self.bundle_pool_config_hashes.get(bundle, {}).get(pool.lower())
            if scoped is not None:
                return scoped
        return self.bundle_config_hash

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


class ConfigDeltaError(ValueError):
    """A config delta that cannot be decoded (not JSON, not an object, wrong types, too big)."""


def encode_config_delta(delta: ConfigDelta) -> bytes:
    """Compact JSON with sorted keys (deterministic bytes for the same delta)."""
    return json.dumps(delta.to_wire(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def decode_config_delta(data: bytes | str) -> ConfigDelta:
    """Decode a ConfigNotification; raises ConfigDeltaError with a readable reason."""
    if isinstance(data, bytes | bytearray | memoryview):
        if len(data) > MAX_CONFIG_DELTA_BYTES:
            raise ConfigDeltaError(f"config delta of {len(data)} bytes exceeds {MAX_CONFIG_DELTA_BYTES}")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigDeltaError(f"config delta is not UTF-8: {exc}") from exc
    else:
        text = data
        if len(text.encode("utf-8")) > MAX_CONFIG_DELTA_BYTES:
            raise ConfigDeltaError(f"config delta exceeds {MAX_CONFIG_DELTA_BYTES} bytes")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ConfigDeltaError(f"config delta is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigDeltaError("config delta must be a JSON object")
    # Tolerate the Rust name for the publisher identity.
    if "router_id" not in obj and "producer_id" in obj:
        obj["router_id"] = obj["producer_id"]
    try:
        return ConfigDelta.model_validate(obj)
    except ValidationError as exc:
        raise ConfigDeltaError(f"invalid config delta: {exc.errors(include_url=False)}") from exc


class EpochOrder(StrEnum):
    """Where a delta's epoch stands against the epoch a consumer has applied."""

    STALE = "stale"  # older than what is applied: drop it
    DUPLICATE = "duplicate"  # the same epoch: another per-bundle copy of a write already applied
    NEXT = "next"  # the very next epoch (or an unversioned delta): apply it
    GAP = "gap"  # newer, with epochs missed in between: apply it and re-export for the rest


def epoch_order(delta_epoch: int, applied_epoch: int) -> EpochOrder:
    """The one rule every consumer of config deltas (gateway, sidecar) follows.

    Epoch 0 is unversioned (a config service without a store never bumps it), so a delta at epoch 0
    while 0 is applied is applied, never taken for a duplicate.
    """
    if delta_epoch < applied_epoch:
        return EpochOrder.STALE
    if delta_epoch == applied_epoch:
        return EpochOrder.NEXT if delta_epoch == 0 else EpochOrder.DUPLICATE
    return EpochOrder.NEXT if delta_epoch == applied_epoch + 1 else EpochOrder.GAP


def epoch_bump_is_news(delta_epoch: int, applied_epoch: int) -> bool:
    """An epoch bump (no model attached) matters only when it is ahead of what is applied."""
    return delta_epoch > applied_epoch


class EpochInfo(BaseModel):
    """``GET /v1/configs/epoch``: poll it; re-export when the epoch or either hash changes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    epoch: int = Field(ge=0)
    bundles_hash: str = ""
    bundle_config_hashes_hash: str = ""

    def differs_from(self, other: EpochInfo | None) -> bool:
        """True when a re-export is due (``""`` hashes are "unknown", not a change)."""
        if other is None or self.epoch != other.epoch:
            return True
        return any(
            a and b and a != b
            for a, b in (
                (self.bundles_hash, other.bundles_hash),
                (self.bundle_config_hashes_hash, other.bundle_config_hashes_hash),
            )
        )


class ExportedModel(BaseModel):
    """One model of ``GET /v1/configs/export``; ``model_config`` is the parsed merged config."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, protected_namespaces=())

    model_id: str
    config: dict[str, Any] = Field(alias="model_config")
    raw_yaml: str = ""
    affected_bundles: list[str] = Field(default_factory=list)
    pool: str = "default"
    source: str = "api"


class ConfigExport(BaseModel):
    """``GET /v1/configs/export``: a consistent snapshot (``epoch`` describes exactly ``models``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    snapshot_version: int = 1
    epoch: int = Field(ge=0)
    generated_at: str = ""
    bundles_hash: str = ""
    bundle_config_hashes_hash: str = ""
    bundle_config_hashes: dict[str, str] = Field(default_factory=dict)
    bundle_pool_config_hashes: dict[str, dict[str, str]] = Field(default_factory=dict)
    bundle_adapters: dict[str, list[str]] = Field(default_factory=dict)
    models: list[ExportedModel] = Field(default_factory=list)


class ResolveBody(BaseModel):
    """``POST /v1/configs/resolve``: which bundle serves ``model`` (``bundle:/org/model`` allowed)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    bundle: str | None = None


def parse_epoch_info(data: bytes | str | dict[str, Any]) -> EpochInfo:
    try:
        return EpochInfo.model_validate(json.loads(data) if isinstance(data, bytes | str) else data)
    except (ValueError, ValidationError) as exc:
        raise ConfigDeltaError(f"invalid epoch response: {exc}") from exc


def parse_export(data: bytes | str | dict[str, Any]) -> ConfigExport:
    try:
        return ConfigExport.model_validate(json.loads(data) if isinstance(data, bytes | str) else data)
    except (ValueError, ValidationError) as exc:
        raise ConfigDeltaError(f"invalid export response: {exc}") from exc


__all__ = [
    "MAX_CONFIG_DELTA_BYTES",
    "ConfigDelta",
    "ConfigDeltaError",
    "ConfigExport",
    "EpochInfo",
    "ExportedModel",
    "decode_config_delta",
    "encode_config_delta",
    "parse_epoch_info",
    "parse_export",
]
