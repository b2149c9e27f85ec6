"""The model catalog as both front doors see it: model specs, profiles, bundles, /v1/models entries.

The worker (``sie serve``) and the gateway resolve a request's model the same way, so the logic
lives here once. A Catalog is an immutable-ish snapshot; writers build a new one or call ``add``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.model_config import (
    OUTPUT_TYPES,
    Bundle,
    ModelConfig,
    Profile,
    bundle_config_hash,
    model_spec,
    parse_bundle_yaml,
    parse_model_yaml,
)


@dataclass(frozen=True)
class Resolved:
    """A request's model after resolution: the config, the profile name and the merged profile."""

    config: ModelConfig
    profile_name: str
    profile: Profile

    @property
    def model_id(self) -> str:
        return self.config.sie_id

    @property
    def runtime_options(self) -> dict[str, Any]:
        opts = self.profile.adapter_options
        return dict(opts.runtime) if opts else {}

    @property
    def loadtime_options(self) -> dict[str, Any]:
        opts = self.profile.adapter_options
        return dict(opts.loadtime) if opts else {}

    @property
    def routable_id(self) -> str:
        return model_spec(self.model_id, self.profile_name)


def supported_outputs(resolved: Resolved) -> list[str]:
    """Encode outputs a profile can produce: its runtime output_types, else the model's encode task."""
    runtime = resolved.runtime_options.get("output_types")
    if runtime:
        return list(runtime)
    enc = resolved.config.tasks.encode
    return enc.outputs() if enc else []


def model_outputs(config: ModelConfig) -> list[str]:
    outs = config.tasks.encode.outputs() if config.tasks.encode else []
    if config.tasks.score is not None:
        outs.append("score")
    if config.tasks.extract is not None:
        outs.append("json")
    if config.tasks.generate is not None:
        outs.append("tokens")
    return outs


def model_dims(config: ModelConfig) -> dict[str, int]:
    dims: dict[str, int] = {}
    enc = config.tasks.encode
    if enc:
        for name in OUTPUT_TYPES:
            out = getattr(enc, name)
            if out is not None and out.dim is not None:
                dims[name] = out.dim
    return dims


class Catalog:
    """Model configs and bundles, with thread-safe replacement of single models."""

    def __init__(self, models: list[ModelConfig] | None = None, bundles: list[Bundle] | None = None) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelConfig] = {m.sie_id: m for m in models or []}
        self._bundles: dict[str, Bundle] = {b.name: b for b in bundles or []}
        self.version = 0  # increases with every write: what a reader derived from it is stale once it moves

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dirs(cls, models_dir: str | Path | None, bundles_dir: str | Path | None) -> Catalog:
        models = []
        bundles = []
        if models_dir and Path(models_dir).is_dir():
            for path in sorted(Path(models_dir).glob("*.yaml")):
                try:
                    models.append(parse_model_yaml(path.read_text()))
                except Exception as exc:  # a broken file names itself
                    raise ValueError(f"{path}: {exc}") from exc
        if bundles_dir and Path(bundles_dir).is_dir():
            for path in sorted(Path(bundles_dir).glob("*.yaml")):
                try:
                    bundles.append(parse_bundle_yaml(path.read_text()))
                except Exception as exc:
                    raise ValueError(f"{path}: {exc}") from exc
        return cls(models, bundles)

    # ---- reads -----------------------------------------------------------------------------
    def models(self) -> list[ModelConfig]:
        with self._lock:
            return list(self._models.values())

    def bundles(self) -> list[Bundle]:
        with self._lock:
            return sorted(self._bundles.values(), key=lambda b: (b.priority, b.name))

    def get(self, model_id: str) -> ModelConfig | None:
        with self._lock:
            return self._models.get(model_id)

    def get_bundle(self, name: str) -> Bundle | None:
        with self._lock:
            return self._bundles.get(name)

    def __contains__(self, model_id: str) -> bool:
        return self.get(model_id) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)

    # ---- writes ----------------------------------------------------------------------------
    def put(self, config: ModelConfig) -> None:
        with self._lock:
            self._models[config.sie_id] = config
            self.version += 1

    def remove(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)
            self.version += 1

    def put_bundle(self, bundle: Bundle) -> None:
        with self._lock:
            self._bundles[bundle.name] = bundle
            self.version += 1

    def replace(self, models: list[ModelConfig], bundles: list[Bundle] | None = None) -> None:
        with self._lock:
            self._models = {m.sie_id: m for m in models}
            if bundles is not None:
                self._bundles = {b.name: b for b in bundles}
            self.version += 1

    # ---- resolution ------------------------------------------------------------------------
    def split_spec(self, spec: str) -> tuple[ModelConfig, str | None]:
        """``M`` or ``M:P`` → (config, profile or None). Raises 404 MODEL_NOT_FOUND."""
        config = self.get(spec)
        if config is not None:
            return config, None
        base, sep, profile = spec.rpartition(":")
        if sep and base:
            config = self.get(base)
            if config is not None and profile in config.profiles:
                return config, profile
        raise SIEError(ErrorCode.MODEL_NOT_FOUND, f"Model '{spec}' not found", model=spec)

    def resolve(self, spec: str, options: dict[str, Any] | None = None) -> Resolved:
        """Resolve a model spec plus an optional ``options.profile`` to one profile."""
        config, profile = self.split_spec(spec)
        requested = (options or {}).get("profile")
        if requested is not None:
            if not isinstance(requested, str) or requested not in config.profiles:
                raise invalid_input(
                    f"Profile '{requested}' not found. Available: {sorted(config.profiles)}", param="profile"
                )
            profile = requested
        if profile is None:
            if "default" not in config.profiles:
                raise SIEError(
                    ErrorCode.MODEL_NOT_FOUND,
                    f"Model '{spec}' has no default profile; use one of "
                    f"{[f'{config.sie_id}:{p}' for p in sorted(config.profiles)]}",
                    model=spec,
                )
            profile = "default"
        return Resolved(config, profile, config.resolved_profile(profile))

    def bundles_for(self, config: ModelConfig, profile: str | None = None) -> list[Bundle]:
        """Bundles that can serve the model (or one profile), best (lowest priority) first."""
        if profile is not None:
            module = config.resolved_profile(profile).adapter_module
            modules = {module} if module else set()
        else:
            modules = config.adapter_modules()
        return [b for b in self.bundles() if modules & set(b.adapters)]

    def bundle_hash(self, bundle_name: str, *, pool: str | None = None) -> str:
        bundle = self.get_bundle(bundle_name)
        if bundle is None:
            return ""
        return bundle_config_hash(bundle, self.models(), pool=pool)

    # ---- listing ---------------------------------------------------------------------------
    def model_entry(
        self,
        config: ModelConfig,
        profile: str | None = None,
        *,
        loaded: bool = False,
        state: str = "available",
        last_error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One ``/v1/models`` entry for ``M`` or its variant ``M:P``."""
        name = model_spec(config.sie_id, profile)
        return {
            "name": name,
            "inputs": config.inputs.names(),
            "outputs": model_outputs(config),
            "dims": model_dims(config),
            "loaded": loaded,
            "state": state,
            "last_error": last_error,
            "max_sequence_length": config.max_sequence_length,
            "revision": config.hf_revision,
            "profiles": {p: {"is_default": p == "default"} for p in sorted(config.profiles)},
            "capabilities": None,
            "routing": {
                "policy": config.routing.policy if config.routing else None,
                "upstream_kind": None,
            },
        }

    def routable_names(self) -> list[tuple[ModelConfig, str]]:
        """Every routable (config, profile) pair: ``M`` for the default profile, ``M:P`` for others."""
        out = []
        for config in sorted(self.models(), key=lambda m: m.sie_id):
            for profile in sorted(config.profiles, key=lambda p: (p != "default", p)):
                out.append((config, profile))
        return out
