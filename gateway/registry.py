"""The gateway's model registry: one interface, one source for now (the worker's catalog YAML).

The config service will replace the source (bootstrap export + NATS deltas); everything else in
the gateway only talks to :class:`ModelRegistry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from protocol.catalog import Catalog, Resolved
from protocol.errors import ErrorCode, SIEError


@dataclass(frozen=True)
class Route:
    """A resolved request model: config + profile, and the bundles able to serve it (best first)."""

    resolved: Resolved
    bundles: list[str]

    @property
    def model_id(self) -> str:
        return self.resolved.model_id


class ModelRegistry(Protocol):
    def resolve(self, spec: str, options: dict[str, Any] | None = None) -> Route: ...

    def bundle_hash(self, bundle: str) -> str: ...

    def bundle_names(self) -> list[str]: ...

    def model_entries(self) -> list[dict[str, Any]]: ...

    def model_entry(self, spec: str) -> dict[str, Any]: ...

    def routable_ids(self) -> list[str]: ...


class CatalogRegistry:
    """ModelRegistry backed by a :class:`protocol.catalog.Catalog` (YAML directories today)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._hashes: dict[str, str] = {}

    @classmethod
    def from_dirs(cls, models_dir: str | None, bundles_dir: str | None) -> CatalogRegistry:
        return cls(Catalog.from_dirs(models_dir, bundles_dir))

    def resolve(self, spec: str, options: dict[str, Any] | None = None) -> Route:
        resolved = self.catalog.resolve(spec, options)
        bundles = [b.name for b in self.catalog.bundles_for(resolved.config, resolved.profile_name)]
        if not bundles:
            raise SIEError(
                ErrorCode.MODEL_NOT_FOUND,
                f"Model '{spec}' is not served by any bundle",
                model=spec,
            )
        return Route(resolved, bundles)

    def bundle_hash(self, bundle: str) -> str:
        cached = self._hashes.get(bundle)
        if cached is None:
            cached = self.catalog.bundle_hash(bundle)
            self._hashes[bundle] = cached
        return cached

    def bundle_names(self) -> list[str]:
        return [b.name for b in self.catalog.bundles()]

    def model_entries(self) -> list[dict[str, Any]]:
        return [
            self.catalog.model_entry(config, profile) for config, profile in self.catalog.routable_names()
        ]

    def model_entry(self, spec: str) -> dict[str, Any]:
        config, profile = self.catalog.split_spec(spec)
        if profile is None and "default" not in config.profiles:
            raise SIEError(ErrorCode.MODEL_NOT_FOUND, f"Model '{spec}' not found", model=spec)
        return self.catalog.model_entry(config, profile)

    def routable_ids(self) -> list[str]:
        return [e["name"] for e in self.model_entries()]
