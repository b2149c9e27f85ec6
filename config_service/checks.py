"""Write-time checks of what the config service can see: a local ``weights_path``, profile
runtime options and our adapters' load-time options.

Runtime options are checked with the same functions (``protocol.params``) the gateway and the
worker apply to every request, so a profile the service accepts cannot make every request to it a
400 later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config_service.rules import ConfigError
from protocol.adapter_options import loadtime_problems
from protocol.catalog import Resolved
from protocol.errors import SIEError
from protocol.model_config import ModelConfig
from protocol.params import instruction, max_length, output_dtype, output_types, pooling, truncates


def check_weights_path(config: ModelConfig, data: dict[str, Any]) -> list[str]:
    """A ``weights_path`` the body names must exist here; warnings for what is only suspicious.

    Refused (400 ``invalid_weights_path``) when the directory is absent and the model has no other
    source (``hf_id`` or ``weights_fallback``); with another source the worker falls back to it,
    so the write is accepted with a warning.
    """
    path = data.get("weights_path")
    if not path:
        return []
    where = Path(str(path)).expanduser()
    if where.is_dir() or where.is_file():
        return []
    if not (config.hf_id or config.weights_fallback):
        raise ConfigError(
            400,
            "invalid_weights_path",
            f"weights_path {path!r} does not exist on the config service and the model names no other "
            "weights source (hf_id or weights_fallback); workers could never load it",
            model_id=config.sie_id,
            weights_path=str(path),
        )
    return [
        f"weights_path {path!r} does not exist on the config service; workers will fall back to hf_id/weights_fallback"
    ]


def check_adapter_options(config: ModelConfig) -> None:
    """Each profile's runtime options pass the request-time checks, and its load-time options are
    ones its adapter reads, of the right type (422 ``validation_error`` else)."""
    details: list[dict[str, Any]] = []
    for name in sorted(config.profiles):
        resolved = Resolved(config, name, config.resolved_profile(name))
        for key, message in loadtime_problems(resolved.profile.adapter_path, resolved.loadtime_options):
            where = (
                ["profiles", name, "adapter_options", "loadtime", key]
                if key
                else ["profiles", name, "adapter_path"]
            )
            details.append({"loc": where, "message": message})
        options = resolved.runtime_options
        loc = ["profiles", name, "adapter_options", "runtime"]
        try:
            truncates(options)
            instruction(None, options)
            output_dtype(None, options)
            pooling(options)
            if "output_types" in options:
                output_types(resolved, options, None)
            max_length(options, is_query=True)
            max_length(options, is_query=False)
        except SIEError as exc:
            details.append({"loc": loc, "message": exc.message})
    if details:
        raise ConfigError(422, "validation_error", "profile adapter options are invalid", details=details)
