"""The IPC front door's config calls: ApplyModelConfig (one model, or a tombstone) and
ReplaceModelConfigs (an export), answered with the bundle_config_hash the worker computes."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from protocol.model_config import ModelConfig, parse_model_yaml

log = logging.getLogger("sie.worker.ipc")


class ConfigRuntime(Protocol):
    """What the config calls need of the runtime (:class:`worker.runtime.Runtime` is one)."""

    @property
    def unsupported_models(self) -> set[str]: ...

    def bundle_config_hash(self, *, pool: str | None = "", adapters: list[str] | None = None) -> str: ...

    async def apply_model_config(
        self, config: ModelConfig, *, bundle_adapters: list[str] | None = None
    ) -> None: ...

    async def replace_model_configs(
        self, configs: list[ModelConfig], *, bundle_adapters: list[str] | None = None
    ) -> None: ...

    async def remove_model_config(
        self, model_id: str, *, bundle_adapters: list[str] | None = None
    ) -> None: ...


class ConfigCalls:
    """The IPC handler's config calls, and the count of those applied (``config_version``)."""

    def __init__(self, runtime: ConfigRuntime) -> None:
        self.runtime = runtime
        self.config_version = 0

    def bundle_hash(self, body: dict[str, Any] | None = None) -> str:
        """The runtime's hash; a config call's body may scope it (``pool_scoped``, ``bundle_adapters``)."""
        pool: str | None = ""  # this worker's own pool
        adapters: list[str] | None = None
        if body is not None:
            if body.get("pool_scoped") is False:
                pool = None  # the control plane sent only the unscoped hash
            sent = body.get("bundle_adapters")
            if isinstance(sent, list) and all(isinstance(a, str) for a in sent):
                adapters = sent
        try:
            return str(self.runtime.bundle_config_hash(pool=pool, adapters=adapters))
        except Exception:  # noqa: BLE001 - a hash problem must not fail Ping
            log.exception("bundle_config_hash failed")
            return ""

    @staticmethod
    def _adapters(body: dict[str, Any]) -> list[str] | None:
        adapters = body.get("bundle_adapters")
        if isinstance(adapters, list) and adapters and all(isinstance(a, str) for a in adapters):
            return list(adapters)
        return None

    def _parse(self, model_id: Any, yaml_text: Any) -> tuple[ModelConfig | None, str | None]:
        """(config or None, rejected model id or None); an empty config is a pure epoch bump."""
        if not isinstance(yaml_text, str) or not yaml_text.strip():
            return None, None
        try:
            return parse_model_yaml(yaml_text), None
        except Exception as exc:  # noqa: BLE001 - schema rejection → unsupported
            log.warning("model config for %s rejected: %s", model_id, exc)
            return None, str(model_id or "?")

    def _unsupported(self, rejected: list[str]) -> list[str]:
        return sorted(set(self.runtime.unsupported_models) | set(rejected))

    async def apply_model_config(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = body.get("model_id")
        if body.get("deleted") is True and isinstance(model_id, str) and model_id:
            await self.runtime.remove_model_config(model_id, bundle_adapters=self._adapters(body))
            config, rejected = None, None
        else:
            config, rejected = self._parse(model_id, body.get("model_config"))
        if config is not None:
            await self.runtime.apply_model_config(config, bundle_adapters=self._adapters(body))
        self.config_version += 1
        return {
            "applied": rejected is None,
            "bundle_config_hash": self.bundle_hash(body),
            "config_version": self.config_version,
            "unsupported_models": self._unsupported([rejected] if rejected else []),
        }

    async def replace_model_configs(self, body: dict[str, Any]) -> dict[str, Any]:
        models = body.get("models") or []
        rejected: list[str] = []
        configs = []
        for entry in models if isinstance(models, list) else []:
            if not isinstance(entry, dict):
                continue
            config, bad = self._parse(entry.get("model_id"), entry.get("model_config"))
            if bad:
                rejected.append(bad)
            elif config is not None:
                configs.append(config)
        await self.runtime.replace_model_configs(configs, bundle_adapters=self._adapters(body))
        self.config_version += 1
        return {
            "applied": not rejected,
            "bundle_config_hash": self.bundle_hash(body),
            "config_version": self.config_version,
            "applied_models": [c.sie_id for c in configs],
            "applied_profiles": sum(len(c.profiles) for c in configs),
            "unsupported_models": self._unsupported(rejected),
        }
