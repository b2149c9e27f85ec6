"""The config rules (pure): bundles, the effective model set, validation and append-only merging.

Nothing here does I/O except the directory loaders; the service feeds a ConfigState built from
a store snapshot and gets back a WritePlan (what a write would change) or a ConfigError.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from iokit.http import config_error_detail
from protocol.codec import CodecError, check_plain
from protocol.model_config import (
    MODEL_ID_RE,
    PROFILE_NAME_RE,
    Bundle,
    ModelConfig,
    Profile,
    bundle_config_hash,
    bundles_hash,
    load_yaml,
    parse_bundle_yaml,
)

POOL_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
UNKNOWN_FIELD_MESSAGE = "Unknown field: the worker model config schema does not define it."
DEFAULT_POOL = "default"


class ConfigError(Exception):
    """A refused request: HTTP status, error code, message and extra detail keys."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra

    def detail(self) -> dict[str, Any]:
        return config_error_detail(self.code, self.message, **self.extra)


class CatalogLoadError(RuntimeError):
    """A bundle or baseline model file that cannot be used."""


# ---- loading -------------------------------------------------------------------------------


def _yaml_files(directory: Path | None) -> list[Path]:
    if directory is None:
        return []
    directory = Path(directory)
    if not directory.is_dir():
        raise CatalogLoadError(f"{directory} is not a directory")
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def load_bundles(directory: Path | None) -> dict[str, Bundle]:
    bundles: dict[str, Bundle] = {}
    for path in _yaml_files(directory):
        try:
            bundle = parse_bundle_yaml(path.read_text(encoding="utf-8"))
        except (ValueError, yaml.YAMLError) as exc:
            raise CatalogLoadError(f"bundle file {path}: {exc}") from exc
        if bundle.name in bundles:
            raise CatalogLoadError(f"bundle {bundle.name!r} defined twice ({path})")
        bundles[bundle.name] = bundle
    return bundles


def load_baseline_models(directory: Path | None) -> dict[str, ModelEntry]:
    models: dict[str, ModelEntry] = {}
    for path in _yaml_files(directory):
        text = path.read_text(encoding="utf-8")
        try:
            data = load_yaml(text)
            if not isinstance(data, dict):
                raise ValueError("a model config must be a YAML mapping")
            config = ModelConfig.model_validate(data)
        except (ValueError, yaml.YAMLError) as exc:
            raise CatalogLoadError(f"model file {path}: {exc}") from exc
        if config.sie_id in models:
            raise CatalogLoadError(f"model {config.sie_id!r} defined twice ({path})")
        models[config.sie_id] = ModelEntry(config=config, data=data, raw_yaml=text, source="filesystem")
    return models


# ---- state ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelEntry:
    config: ModelConfig
    data: dict[str, Any]  # the config as a plain mapping (what the YAML says, pool lower-cased)
    raw_yaml: str
    source: str  # "api" | "filesystem"

    @property
    def pool(self) -> str:
        return model_pool(self.config)


def model_pool(config: ModelConfig) -> str:
    return (config.pool or DEFAULT_POOL).lower()


def entry_from_yaml(raw_yaml: str, source: str = "api") -> ModelEntry:
    data = load_yaml(raw_yaml)
    if not isinstance(data, dict):
        raise ValueError("stored model config is not a mapping")
    return ModelEntry(config=ModelConfig.model_validate(data), data=data, raw_yaml=raw_yaml, source=source)


def dump_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)


def _sha(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass
class ConfigState:
    """Bundles + baseline models + API models at one epoch; derived values are cached."""

    epoch: int
    bundles: dict[str, Bundle]
    baseline: dict[str, ModelEntry]
    api: dict[str, ModelEntry]
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def models(self) -> dict[str, ModelEntry]:
        if "models" not in self._cache:
            merged = dict(self.baseline)
            merged.update(self.api)
            self._cache["models"] = dict(sorted(merged.items()))
        models: dict[str, ModelEntry] = self._cache["models"]
        return models

    def with_model(self, epoch: int, entry: ModelEntry) -> ConfigState:
        api = dict(self.api)
        api[entry.config.sie_id] = entry
        return ConfigState(epoch=epoch, bundles=self.bundles, baseline=self.baseline, api=api)

    def without_model(self, epoch: int, model_id: str) -> ConfigState:
        """The state after a DELETE: the API entry goes (a filesystem baseline of that id reappears)."""
        api = {mid: e for mid, e in self.api.items() if mid != model_id}
        return ConfigState(epoch=epoch, bundles=self.bundles, baseline=self.baseline, api=api)

    # bundles
    def bundles_for_module(self, module: str | None) -> list[str]:
        return [name for name, b in self.sorted_bundles() if module in b.adapters]

    def sorted_bundles(self) -> list[tuple[str, Bundle]]:
        return sorted(self.bundles.items(), key=lambda kv: (kv[1].priority, kv[0]))

    def routable_bundles_by_profile(self, config: ModelConfig) -> dict[str, list[str]]:
        return {
            name: self.bundles_for_module(config.resolved_profile(name).adapter_module)
            for name in sorted(config.profiles)
        }

    def affected_bundles(self, config: ModelConfig) -> list[str]:
        """Bundles a model is routable to, lowest priority (the default resolution) first."""
        modules = config.adapter_modules()
        return [name for name, b in self.sorted_bundles() if modules & set(b.adapters)]

    def bundle_config_hashes(self) -> dict[str, str]:
        if "bch" not in self._cache:
            configs = [e.config for e in self.models.values()]
            self._cache["bch"] = {
                name: bundle_config_hash(b, configs) for name, b in sorted(self.bundles.items())
            }
        hashes: dict[str, str] = self._cache["bch"]
        return hashes

    def bundle_pool_config_hashes(self) -> dict[str, dict[str, str]]:
        if "bpch" not in self._cache:
            configs = [e.config for e in self.models.values()]
            out: dict[str, dict[str, str]] = {}
            for name, b in sorted(self.bundles.items()):
                pools = {DEFAULT_POOL}
                pools.update(e.pool for e in self.models.values() if name in self.affected_bundles(e.config))
                out[name] = {p: bundle_config_hash(b, configs, pool=p) for p in sorted(pools)}
            self._cache["bpch"] = out
        per_pool: dict[str, dict[str, str]] = self._cache["bpch"]
        return per_pool

    def bundle_adapters(self) -> dict[str, list[str]]:
        return {name: list(b.adapters) for name, b in sorted(self.bundles.items())}

    def bundles_hash(self) -> str:
        return bundles_hash(list(self.bundles.values()))

    def bundle_config_hashes_hash(self) -> str:
        """One fingerprint over every bundle's config hash and which pool owns each model."""
        if not self.bundles:
            return ""
        return _sha(
            {
                "bundle_config_hashes": self.bundle_config_hashes(),
                "model_pools": {mid: e.pool for mid, e in self.models.items()},
            }
        )

    def epoch_info(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "bundles_hash": self.bundles_hash(),
            "bundle_config_hashes_hash": self.bundle_config_hashes_hash(),
        }

    def export(self) -> dict[str, Any]:
        return {
            "snapshot_version": 1,
            "epoch": self.epoch,
            "generated_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "bundles_hash": self.bundles_hash(),
            "bundle_config_hashes_hash": self.bundle_config_hashes_hash(),
            "bundle_config_hashes": self.bundle_config_hashes(),
            "bundle_pool_config_hashes": self.bundle_pool_config_hashes(),
            "bundle_adapters": self.bundle_adapters(),
            "models": [
                {
                    "model_id": mid,
                    "model_config": e.config.model_dump(mode="json", exclude_none=True),
                    "raw_yaml": e.raw_yaml,
                    "affected_bundles": self.affected_bundles(e.config),
                    "pool": e.pool,
                    "source": e.source,
                }
                for mid, e in self.models.items()
            ],
        }

    def models_listing(self) -> dict[str, Any]:
        return {
            "models": [
                {"model_id": mid, "profiles": sorted(e.config.profiles), "source": e.source}
                for mid, e in self.models.items()
            ]
        }

    def bundles_listing(self) -> dict[str, Any]:
        return {
            "bundles": [
                {
                    "bundle_id": name,
                    "engine": b.engine,
                    "priority": b.priority,
                    "adapter_count": len(b.adapters),
                    "source": "filesystem",
                }
                for name, b in self.sorted_bundles()
            ]
        }


# ---- the write plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class WritePlan:
    """What an accepted POST changes. ``changed`` False = an identical replay."""

    model_id: str
    entry: ModelEntry
    created_profiles: list[str]
    existing_profiles_skipped: list[str]
    added_fields: list[str]
    is_new_model: bool
    warnings: list[str]

    @property
    def changed(self) -> bool:
        return bool(self.created_profiles or self.added_fields or self.is_new_model)


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(400, "parse_error", f"Invalid YAML: body is not UTF-8 ({exc})") from exc
    try:
        data = load_yaml(text)
        check_plain(data)
    except (yaml.YAMLError, CodecError) as exc:
        raise ConfigError(400, "parse_error", f"Invalid YAML: {exc}") from exc
    except RecursionError:
        raise ConfigError(400, "parse_error", "Invalid YAML: nested too deeply") from None
    except ValueError as exc:  # a scalar YAML cannot construct, e.g. an int past Python's digit limit
        raise ConfigError(400, "parse_error", f"Invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(400, "parse_error", "Invalid YAML: the top level must be a mapping")
    return data


def _loc(err: Mapping[str, Any]) -> list[Any]:
    return [p for p in err.get("loc", ())]


def _structural_check(data: dict[str, Any]) -> None:
    """Unknown keys and wrong types are refused strictly; missing fields are allowed here (a
    body may append profiles to a stored model) and checked on the merged config later."""
    if not isinstance(data.get("profiles", {}), dict):
        raise ConfigError(
            422,
            "validation_error",
            "profiles must be a mapping",
            details=[{"loc": ["profiles"], "message": "profiles must be a mapping of name to profile"}],
        )
    try:
        ModelConfig.model_validate(data)
        return
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    details = []
    for err in errors:
        loc = _loc(err)
        if err["type"] == "missing":
            continue
        if not loc:  # a model-level rule: judged on the merged config
            continue
        if loc == ["sie_id"] and err["type"] == "value_error":
            continue  # id syntax: 400 invalid_model_id, below
        if err["type"] == "value_error" and len(loc) == 2 and loc[0] == "profiles":
            continue  # per-profile rules (extends/adapter_path): judged on the merged config
        message = UNKNOWN_FIELD_MESSAGE if err["type"] == "extra_forbidden" else err["msg"]
        details.append({"loc": loc, "message": message})
    if details:
        raise ConfigError(422, "validation_error", "model config failed schema validation", details=details)


def check_model_id(model_id: Any) -> str:
    if model_id is None:
        raise ConfigError(422, "validation_error", "missing sie_id", details=[{"message": "missing sie_id"}])
    if not isinstance(model_id, str):
        raise ConfigError(
            422,
            "validation_error",
            "sie_id must be a string",
            details=[{"loc": ["sie_id"], "message": "sie_id must be a string"}],
        )
    if (
        not MODEL_ID_RE.match(model_id)
        or ".." in model_id
        or "\\" in model_id
        or model_id == "status"
        or model_id.endswith("/status")
        or len(model_id) > 512
    ):
        raise ConfigError(400, "invalid_model_id", f"invalid model id {model_id!r}", model_id=model_id)
    return model_id


def _semantic(message: str) -> ConfigError:
    return ConfigError(422, "validation_error", message, details=[{"message": message}])


def _canon_profile(value: Any) -> str:
    return json.dumps(
        Profile.model_validate(value).model_dump(mode="json", exclude_none=True), sort_keys=True
    )


def _canon_field(key: str, value: Any) -> str:
    info = ModelConfig.model_fields.get(key)
    if info is None or info.annotation is None:
        return json.dumps(value, sort_keys=True, default=str)
    adapter: TypeAdapter[Any] = TypeAdapter(info.annotation)
    normalized = adapter.validate_python(value)
    dumped = adapter.dump_python(normalized, mode="json", exclude_none=True)
    if key == "pool" and isinstance(dumped, str):
        dumped = dumped.lower()
    return json.dumps(dumped, sort_keys=True)


def check_profiles_and_pool(data: dict[str, Any]) -> dict[str, Any]:
    """The body's profiles (names and shapes) and its pool (lower-cased in ``data``); returns the profiles."""
    profiles = data.get("profiles")
    if not profiles or not isinstance(profiles, dict):
        raise _semantic("profiles must be a non-empty mapping")
    for name, prof in profiles.items():
        if not isinstance(name, str) or not PROFILE_NAME_RE.match(name):
            raise _semantic(f"invalid profile name {name!r}: must match [A-Za-z0-9._-]+")
        if not isinstance(prof, dict):
            raise _semantic(f"profile {name!r} must be a mapping")
    if "pool" in data and data["pool"] is not None:
        pool = data["pool"]
        if not isinstance(pool, str) or not POOL_RE.match(pool) or pool.lower() == "_default":
            raise _semantic(f"invalid pool {pool!r}: must match [A-Za-z0-9_-]{{1,128}} and not be _default")
        data["pool"] = pool.lower()
    return profiles


def validate_merged(
    state: ConfigState, merged: dict[str, Any], new_profiles: list[str], *, threshold_routing_enabled: bool
) -> ModelConfig:
    """The whole config a write would store: schema, the new profiles' adapters, a bundle, routing,
    and what the config service can check of the weights and adapter options (config_service.checks)."""
    try:
        config = ModelConfig.model_validate(merged)
    except ValidationError as exc:
        details = [
            {"loc": _loc(e), "message": UNKNOWN_FIELD_MESSAGE if e["type"] == "extra_forbidden" else e["msg"]}
            for e in exc.errors(include_url=False)
        ]
        raise ConfigError(422, "validation_error", "model config is invalid", details=details) from exc

    # Every new profile's adapter must be served by some bundle.
    known = {m for b in state.bundles.values() for m in b.adapters}
    missing = sorted(
        {
            m
            for name in new_profiles
            for m in [config.resolved_profile(name).adapter_module]
            if m and m not in known
        }
    )
    if missing:
        raise _semantic(f"Adapter(s) not in any known bundle: {', '.join(missing)}")
    if not state.affected_bundles(config):
        raise _semantic(f"model {config.sie_id!r} resolves to no bundle")
    _check_routing(config, threshold_routing_enabled)
    return config


def plan_add(state: ConfigState, body: bytes, *, threshold_routing_enabled: bool = False) -> WritePlan:
    """Validate a POST body against the current state and work out the append-only merge."""
    data = parse_body(body)
    _structural_check(data)
    model_id = check_model_id(data.get("sie_id"))
    profiles = check_profiles_and_pool(data)

    existing = state.models.get(model_id)
    if existing is None:
        merged: dict[str, Any] = dict(data)
        merged["profiles"] = dict(profiles)
        created = list(profiles)
        skipped: list[str] = []
        added_fields: list[str] = []
        conflicting_profiles: list[str] = []
        conflicting_fields: list[str] = []
    else:
        merged = json.loads(json.dumps(existing.data))  # deep copy of plain data
        merged_profiles = dict(merged.get("profiles") or {})
        created, skipped, conflicting_profiles = [], [], []
        for name, prof in profiles.items():
            if name in merged_profiles:
                try:
                    same = _canon_profile(prof) == _canon_profile(merged_profiles[name])
                except ValidationError:
                    same = False
                (skipped if same else conflicting_profiles).append(name)
            else:
                created.append(name)
                merged_profiles[name] = prof
        merged["profiles"] = merged_profiles
        added_fields, conflicting_fields = [], []
        for key, value in data.items():
            if key in ("profiles", "sie_id"):
                continue
            if key == "pool":
                if (value or DEFAULT_POOL) != existing.pool:
                    raise _semantic(
                        f"pool: model {model_id!r} already exists with different value "
                        f"({existing.pool!r}, not {value!r})"
                    )
                if "pool" not in merged and value is not None:
                    merged["pool"] = value
                continue
            if key in merged and merged[key] is not None:
                if _canon_field(key, value) != _canon_field(key, merged[key]):
                    conflicting_fields.append(key)
            elif value is not None:
                merged[key] = value
                added_fields.append(key)

    config = validate_merged(state, merged, created, threshold_routing_enabled=threshold_routing_enabled)

    if conflicting_profiles or conflicting_fields:
        extra: dict[str, Any] = {"model_id": model_id}
        parts = []
        if conflicting_profiles:
            extra["conflicting_profiles"] = sorted(conflicting_profiles)
            parts.append(f"profiles {sorted(conflicting_profiles)}")
        if conflicting_fields:
            extra["conflicting_fields"] = sorted(conflicting_fields)
            parts.append(f"fields {sorted(conflicting_fields)}")
        raise ConfigError(
            409,
            "content_conflict",
            f"model {model_id!r} already has {' and '.join(parts)} with different content; "
            "configs are append-only (add a new profile instead)",
            **extra,
        )

    entry = ModelEntry(config=config, data=merged, raw_yaml=dump_yaml(merged), source="api")
    return WritePlan(
        model_id=model_id,
        entry=entry,
        created_profiles=created,
        existing_profiles_skipped=skipped,
        added_fields=added_fields,
        is_new_model=existing is None,
        warnings=[],
    )


@dataclass(frozen=True)
class ReplacePlan:
    """What an accepted PUT changes. ``previous`` is the effective config before (None = new)."""

    model_id: str
    entry: ModelEntry
    previous: ModelEntry | None
    unchanged: bool


def canonical(config: ModelConfig) -> str:
    """A config's content, independent of YAML spelling and key order."""
    return json.dumps(config.model_dump(mode="json", exclude_none=True), sort_keys=True)


def plan_replace(
    state: ConfigState, model_id: str, body: bytes, *, threshold_routing_enabled: bool = False
) -> ReplacePlan:
    """Validate a PUT body (a whole config) for ``model_id``: POST's rules minus the append-only gate."""
    data = parse_body(body)
    _structural_check(data)
    body_id = check_model_id(data.get("sie_id"))
    if body_id != model_id:
        raise ConfigError(
            400,
            "model_id_mismatch",
            f"body sie_id {body_id!r} does not match the path's model id {model_id!r}",
            model_id=model_id,
        )
    profiles = check_profiles_and_pool(data)
    previous = state.models.get(model_id)
    if previous is not None and (data.get("pool") or DEFAULT_POOL) != previous.pool:
        raise _semantic(
            f"pool: model {model_id!r} already exists with different value ({previous.pool!r}, not "
            f"{data.get('pool')!r}); DELETE the model and add it again to move it to another pool"
        )
    config = validate_merged(state, data, list(profiles), threshold_routing_enabled=threshold_routing_enabled)
    entry = ModelEntry(config=config, data=data, raw_yaml=dump_yaml(data), source="api")
    # the same content as what is served (an API config, or the image's) changes nothing
    unchanged = previous is not None and canonical(previous.config) == canonical(config)
    return ReplacePlan(model_id=model_id, entry=entry, previous=previous, unchanged=unchanged)


def _check_routing(config: ModelConfig, threshold_enabled: bool) -> None:
    routing = config.routing
    if routing is None or routing.policy is None:
        return
    if routing.policy == "threshold" and not threshold_enabled:
        raise _semantic("routing policy 'threshold' is disabled (set SIE_THRESHOLD_ROUTING_ENABLED=true)")
    if routing.policy == "remote_only" and (not config.remote_backed or config.weights_path):
        raise _semantic("routing policy 'remote_only' needs remote_backed: true and no weights_path")
    if routing.policy == "fallback":
        fb = routing.fallback_profile
        if "default" not in config.profiles:
            raise _semantic("routing policy 'fallback' needs a 'default' profile")
        if not fb or fb == "default" or fb not in config.profiles:
            raise _semantic("routing policy 'fallback' needs fallback_profile naming a non-default profile")
