"""The config service as the gateway reads it over HTTP: its epoch, and a whole snapshot of its
bundles and models (epoch → bundles → export), parsed fully before anyone installs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import yaml

from iokit.replicas import ReplicaUrls
from protocol.config_delta import ConfigExport, EpochInfo, parse_epoch_info, parse_export
from protocol.model_config import Bundle, ModelConfig, load_yaml, parse_model_yaml


class BootstrapError(Exception):
    """The config service answered badly (HTTP status, unparsable body, invalid config)."""


@dataclass(frozen=True)
class ConfigSnapshot:
    """What one sync read: the epoch asked first, the bundles, the export and its models parsed
    (with each model's YAML as sent and its source, by model id)."""

    info: EpochInfo
    bundles: list[Bundle]
    export: ConfigExport
    models: list[ModelConfig]
    raw_yaml: dict[str, str]
    sources: dict[str, str]


class ConfigClient:
    def __init__(self, url: str, *, token: str | None = None, http_timeout_s: float = 10.0) -> None:
        self.replicas = ReplicaUrls(url)
        self.token = token or None
        self.http_timeout_s = http_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.http_timeout_s),
            headers={"Authorization": f"Bearer {self.token}"} if self.token else None,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def epoch_info(self) -> EpochInfo:
        return parse_epoch_info(await self._get_doc("/v1/configs/epoch"))

    async def snapshot(self) -> ConfigSnapshot:
        """Epoch → bundles → export, every part parsed (BootstrapError when one is not valid)."""
        info = await self.epoch_info()
        listing = await self._get_doc("/v1/configs/bundles")
        bundles: list[Bundle] = []
        for entry in (listing or {}).get("bundles", []):
            bundle_id = entry.get("bundle_id") or entry.get("name")
            doc = await self._get_doc(f"/v1/configs/bundles/{bundle_id}?format=json")
            if not isinstance(doc, dict):
                raise BootstrapError(f"bundle {bundle_id!r}: not a mapping")
            bundles.append(
                Bundle(
                    name=doc.get("name") or bundle_id,
                    priority=int(doc.get("priority", entry.get("priority", 100))),
                    adapters=list(doc.get("adapters") or []),
                    engine=doc.get("engine") or "pytorch",
                )
            )
        export = parse_export(await self._get_doc("/v1/configs/export"))
        models: list[ModelConfig] = []
        raw: dict[str, str] = {}
        sources: dict[str, str] = {}
        for m in export.models:
            try:
                config = (
                    parse_model_yaml(m.raw_yaml)
                    if m.raw_yaml.strip()
                    else ModelConfig.model_validate(m.config)
                )
            except Exception as exc:
                raise BootstrapError(f"export model {m.model_id!r}: {exc}") from exc
            models.append(config)
            raw[config.sie_id] = m.raw_yaml
            sources[config.sie_id] = m.source
        return ConfigSnapshot(info, bundles, export, models, raw, sources)

    async def _get_doc(self, path: str) -> Any:
        assert self._session is not None, "open() first"
        status, text = await self.replicas.get(self._session, path, headers={"Accept": "application/json"})
        if status != 200:
            raise BootstrapError(f"GET {path}: HTTP {status}: {text[:200]}")
        try:
            return load_yaml(text)  # JSON is YAML; the reference answers bundles as YAML
        except yaml.YAMLError as exc:
            raise BootstrapError(f"GET {path}: unparsable body: {exc}") from exc
