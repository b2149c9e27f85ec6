"""Control-plane model config on the worker: apply one model, replace all, bundle hash, support."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Protocol

from protocol.catalog import Catalog
from protocol.model_config import Bundle, ModelConfig, bundle_config_hash

log = logging.getLogger("worker.runtime")


class StaleModels(Protocol):
    """Loaded models a config change leaves behind (:class:`worker.models.registry.ModelRegistry`)."""

    async def drop_stale(self, model_id: str) -> None:
        """Unload (or forget) the model's instances that no longer match the catalog's config."""
        ...


class ControlConfig:
    """The catalog as the control plane changes it (ApplyModelConfig / ReplaceModelConfigs from the
    sidecar), the bundle hash it is compared by, and which models this image cannot run."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        bundle: str,
        pool: str,
        stale: StaleModels,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """``bundle``, ``pool``: this worker's (``SIE_BUNDLE``, ``SIE_POOL``); ``on_change`` is called
        after every change of the catalog (the weights report checks again)."""
        self.catalog = catalog
        self.on_change = on_change
        self.bundle = bundle
        self.pool = pool
        self.stale = stale
        # the image's own models, what a tombstone or an export brings back
        self._baseline: dict[str, ModelConfig] = {m.sie_id: m for m in catalog.models()}
        self._control_adapters: list[str] | None = None  # the bundle's adapters as the config service sees it
        self.unsupported_models: set[str] = set()
        self._importable: dict[str, bool] = {}

    def bundle_config_hash(self, *, pool: str | None = "", adapters: list[str] | None = None) -> str:
        """This worker's hash of its bundle, scoped to ``pool``.

        ``pool=""`` (the default) means this worker's own pool (``SIE_POOL``); ``None`` = unscoped,
        every model of the bundle. The config service publishes both: ``bundle_config_hash``
        (unscoped) and ``bundle_pool_config_hashes[bundle][pool]``; the sidecar compares the scoped
        one when the control plane sends it. The bundle's adapter list is the control plane's when it
        sent one (so both sides hash the same profiles), else the image's bundle file.
        """
        bundle = self._bundle(adapters)
        if bundle is None:
            return ""
        scope = self.pool if pool == "" else pool
        return bundle_config_hash(bundle, self.catalog.models(), pool=scope)

    def _bundle(self, adapters: list[str] | None = None) -> Bundle | None:
        adapters = adapters if adapters is not None else self._control_adapters
        if adapters is not None:
            return Bundle(name=self.bundle, adapters=list(adapters))
        return self.catalog.get_bundle(self.bundle)

    def _module_importable(self, module: str) -> bool:
        ok = self._importable.get(module)
        if ok is None:
            try:
                ok = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                ok = False
            self._importable[module] = ok
        return ok

    def is_supported(self, config: ModelConfig) -> bool:
        """False when a profile this bundle would serve names an adapter module this image lacks."""
        bundle = self._bundle()
        modules = set(bundle.adapters) if bundle is not None else None
        for name in config.profiles:
            module = config.resolved_profile(name).adapter_module
            if module and (modules is None or module in modules) and not self._module_importable(module):
                return False
        return True

    def _note_support(self, config: ModelConfig) -> None:
        if self.is_supported(config):
            self.unsupported_models.discard(config.sie_id)
        else:
            log.warning("model %s names an adapter this worker image lacks: unsupported", config.sie_id)
            self.unsupported_models.add(config.sie_id)

    async def apply_model_config(
        self, config: ModelConfig, *, bundle_adapters: list[str] | None = None
    ) -> None:
        """Add or update one model (the full merged config of a delta); other models stay as they are.

        Loaded entries of the model whose load-time state changed are unloaded, so the next request
        loads the new profile instead of silently running the old one.
        """
        if bundle_adapters is not None:
            self._control_adapters = list(bundle_adapters)
        old = self.catalog.get(config.sie_id)
        self.catalog.put(config)
        self._note_support(config)
        self.on_change()
        if old is not None and old != config:
            await self.stale.drop_stale(config.sie_id)

    async def remove_model_config(self, model_id: str, *, bundle_adapters: list[str] | None = None) -> None:
        """A tombstone: the model goes (the image's own config of that id, if any, comes back) and
        its loaded entries are unloaded."""
        if bundle_adapters is not None:
            self._control_adapters = list(bundle_adapters)
        baseline = self._baseline.get(model_id)
        if baseline is not None:
            self.catalog.put(baseline)
            self._note_support(baseline)
        else:
            self.catalog.remove(model_id)
            self.unsupported_models.discard(model_id)
        self.on_change()
        log.info(
            "model %s removed by the control plane%s",
            model_id,
            " (image config restored)" if baseline else "",
        )
        await self.stale.drop_stale(model_id)

    async def replace_model_configs(
        self, configs: list[ModelConfig], *, bundle_adapters: list[str] | None = None
    ) -> None:
        """The control plane's full model set (an export): image models not named keep their baseline."""
        if bundle_adapters is not None:
            self._control_adapters = list(bundle_adapters)
        before = {m.sie_id: m for m in self.catalog.models()}
        wanted = dict(self._baseline)
        wanted.update({c.sie_id: c for c in configs})
        self.catalog.replace(list(wanted.values()))  # bundles are kept
        self.unsupported_models = set()
        for config in wanted.values():
            self._note_support(config)
        self.on_change()
        for model_id, old in before.items():
            if wanted.get(model_id) != old:
                await self.stale.drop_stale(model_id)
