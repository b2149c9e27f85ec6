"""The gateway's model registry: one interface, two sources.

* :class:`CatalogRegistry` reads the catalog YAML directories (``SIE_MODELS_DIR``,
  ``SIE_BUNDLES_DIR``) once; used when no config service is configured.
* :class:`gateway.config_sync.ConfigServiceRegistry` mirrors the config service (bootstrap
  export + NATS deltas + epoch poll); used when ``SIE_CONFIG_SERVICE_URL`` is set.

Everything else in the gateway only talks to :class:`ModelRegistry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import yaml

from protocol.catalog import Catalog, Resolved
from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig, bundles_hash


@dataclass(frozen=True)
class Route:
    """A resolved request model: config + profile, and the bundles able to serve it (best first)."""

    resolved: Resolved
    bundles: list[str]

    @property
    def model_id(self) -> str:
        return self.resolved.model_id


class ConfigModel(TypedDict):
    model_id: str
    profiles: list[str]
    source: str  # filesystem, or where the config service got it


class ConfigModels(TypedDict):
    """``GET /v1/configs/models``."""

    models: list[ConfigModel]


class ConfigBundleRow(TypedDict):
    bundle_id: str
    engine: str
    priority: int
    adapter_count: int
    source: str


class ConfigBundles(TypedDict):
    """``GET /v1/configs/bundles``."""

    bundles: list[ConfigBundleRow]


class ConfigBundle(TypedDict):
    """``GET /v1/configs/bundles/{id}``."""

    name: str
    engine: str
    priority: int
    source: str
    adapters: list[str]


class ConfigEpoch(TypedDict):
    """``GET /v1/configs/epoch``."""

    epoch: int
    bundles_hash: str
    source: str


class ModelRegistry(Protocol):
    def resolve(self, spec: str, options: dict[str, Any] | None = None) -> Route: ...

    def bundle_hash(self, bundle: str) -> str: ...

    def expected_hash(self, bundle: str, pool: str) -> str: ...

    def model_config(self, model_id: str) -> ModelConfig | None: ...

    def model_bundles(self, config: ModelConfig) -> list[str]: ...

    def bundle_names(self) -> list[str]: ...

    def model_entries(self) -> list[dict[str, Any]]: ...

    def model_entry(self, spec: str) -> dict[str, Any]: ...

    def routable_ids(self) -> list[str]: ...

    # lifecycle: a source may sync in the background; ``ready()`` gates ``/readyz``
    def ready(self) -> bool: ...

    async def start(self, nc: Any, metrics: Any = None) -> None: ...

    async def stop(self) -> None: ...

    # read-side config API (``GET /v1/configs/...`` on the gateway)
    def config_models(self) -> ConfigModels: ...

    def config_model_yaml(self, model_id: str) -> str | None: ...

    def config_bundles(self) -> ConfigBundles: ...

    def config_bundle(self, bundle_id: str) -> ConfigBundle | None: ...

    def config_epoch(self) -> ConfigEpoch: ...


class CatalogRegistry:
    """ModelRegistry backed by a :class:`protocol.catalog.Catalog` (YAML directories today)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._hashes: dict[str, str] = {}
        # every request resolves its model: the routes of the catalog's current version, by
        # (spec, options.profile); a write to the catalog empties it
        self._routes: dict[tuple[str, str | None], Route] = {}
        self._routes_version = -1

    @classmethod
    def from_dirs(cls, models_dir: str | None, bundles_dir: str | None) -> CatalogRegistry:
        return cls(Catalog.from_dirs(models_dir, bundles_dir))

    def resolve(self, spec: str, options: dict[str, Any] | None = None) -> Route:
        requested = (options or {}).get("profile")
        if requested is not None and not isinstance(requested, str):
            return self._resolve(spec, options)  # refused with the catalog's own error
        if self._routes_version != self.catalog.version:
            self._routes, self._routes_version = {}, self.catalog.version
        key = (spec, requested)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._resolve(spec, options)
        return route

    def _resolve(self, spec: str, options: dict[str, Any] | None) -> Route:
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

    def expected_hash(self, bundle: str, pool: str) -> str:
        """The bundle_config_hash an up-to-date worker of ``bundle`` in ``pool`` advertises (without a
        control plane a worker hashes its bundle scoped to its own pool)."""
        return self.catalog.bundle_hash(bundle, pool=pool)

    def model_config(self, model_id: str) -> ModelConfig | None:
        return self.catalog.get(model_id)

    def model_bundles(self, config: ModelConfig) -> list[str]:
        return [b.name for b in self.catalog.bundles_for(config)]

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

    # ---- lifecycle (nothing to sync) ------------------------------------------------------
    def ready(self) -> bool:
        return True

    async def start(self, nc: Any, metrics: Any = None) -> None:
        return None

    async def stop(self) -> None:
        return None

    # ---- read-side config API --------------------------------------------------------------
    def config_models(self) -> ConfigModels:
        return {
            "models": [
                {"model_id": m.sie_id, "profiles": sorted(m.profiles), "source": "filesystem"}
                for m in sorted(self.catalog.models(), key=lambda m: m.sie_id)
            ]
        }

    def config_model_yaml(self, model_id: str) -> str | None:
        config = self.catalog.get(model_id)
        if config is None:
            return None
        return yaml.safe_dump(config.model_dump(mode="json", exclude_none=True), sort_keys=False)

    def config_bundles(self) -> ConfigBundles:
        return {
            "bundles": [
                {
                    "bundle_id": b.name,
                    "engine": b.engine,
                    "priority": b.priority,
                    "adapter_count": len(b.adapters),
                    "source": "filesystem",
                }
                for b in self.catalog.bundles()
            ]
        }

    def config_bundle(self, bundle_id: str) -> ConfigBundle | None:
        b = self.catalog.get_bundle(bundle_id)
        if b is None:
            return None
        return {
            "name": b.name,
            "engine": b.engine,
            "priority": b.priority,
            "source": "filesystem",
            "adapters": list(b.adapters),
        }

    def config_epoch(self) -> ConfigEpoch:
        return {"epoch": 0, "bundles_hash": bundles_hash(self.catalog.bundles()), "source": "filesystem"}
