"""Where a model's weights come from: a local path, the Hugging Face hub, or a packaged fallback.

A weights source is a local directory (``weights_path``), a hub id (``hf_id``), or a directory
inside an installed Python package written ``pkg://<package>/<subdir>`` (``weights_fallback``,
used when the hub cannot be reached).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from protocol.model_config import ModelConfig

log = logging.getLogger(__name__)


class WeightsError(Exception):
    """Weights could not be found; ``error_class`` says why (NOT_FOUND, GATED, NETWORK)."""

    def __init__(self, message: str, error_class: str = "NOT_FOUND", permanent: bool = True) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.permanent = permanent


def resolve_path(source: str) -> Path:
    """A local path or ``pkg://package/subdir`` as a filesystem path (not checked for existence)."""
    if source.startswith("pkg://"):
        package, _, sub = source[len("pkg://") :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise WeightsError(f"package {package!r} is not installed (needed for {source})")
        return Path(next(iter(spec.submodule_search_locations))) / sub
    return Path(source).expanduser()


def hub_offline(settings_offline: bool) -> bool:
    return settings_offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def download_from_hub(hf_id: str, revision: str | None, offline: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(hf_id, revision=revision, local_files_only=offline))
    except GatedRepoError as exc:
        raise WeightsError(f"{hf_id} is gated: set HF_TOKEN with access ({exc})", "GATED") from exc
    except RepositoryNotFoundError as exc:
        raise WeightsError(f"{hf_id} does not exist on the hub", "NOT_FOUND") from exc
    except Exception as exc:  # network down, offline cache miss, ...
        raise WeightsError(f"{hf_id}: hub unreachable or not cached ({exc})", "NETWORK", permanent=True) from exc


def resolve_weights(config: ModelConfig, *, offline: bool = False) -> Path | None:
    """The local directory holding the model's weights (``None`` for package-backed models)."""
    if config.package_backed and not (config.weights_path or config.hf_id or config.weights_fallback):
        return None
    if config.weights_path:
        path = resolve_path(config.weights_path)
        if path.exists():
            return path
        if not (config.hf_id or config.weights_fallback):
            raise WeightsError(f"weights_path {config.weights_path} does not exist")
    hub_error: WeightsError | None = None
    if config.hf_id:
        try:
            return download_from_hub(config.hf_id, config.hf_revision, hub_offline(offline))
        except WeightsError as exc:
            if exc.error_class == "GATED":
                raise
            hub_error = exc
    if config.weights_fallback:
        path = resolve_path(config.weights_fallback)
        if path.exists():
            if hub_error is not None:
                log.info("%s: hub unavailable, using packaged weights at %s", config.sie_id, path)
            return path
        raise WeightsError(f"fallback weights {config.weights_fallback} do not exist")
    if hub_error is not None:
        raise hub_error
    raise WeightsError(f"{config.sie_id} names no weights source (weights_path, hf_id or weights_fallback)")
