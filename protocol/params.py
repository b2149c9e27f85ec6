"""Validation of request parameters, shared by the worker and the gateway.

The gateway checks a request before publishing it and the worker checks it again before running
it; both use these functions, so a request gets the same 400 INVALID_INPUT from either.
"""

from __future__ import annotations

from typing import Any

from protocol.api import OVERFLOW_POLICIES
from protocol.catalog import Resolved, supported_outputs
from protocol.errors import invalid_input
from protocol.model_config import OUTPUT_TYPES

OUTPUT_DTYPES = ("float32", "float16", "int8", "uint8", "binary", "ubinary")


def request_options(value: Any) -> dict[str, Any]:
    """A request's ``options`` as a fresh dict (``None`` → ``{}``); anything but a map is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_input("options must be a map", param="options")
    return dict(value)


def merged_options(resolved: Resolved, request: Any) -> dict[str, Any]:
    """Profile runtime options overlaid with the request's options (request wins; ``profile`` dropped)."""
    options = {**resolved.runtime_options, **request_options(request)}
    options.pop("profile", None)
    return options


def instruction(explicit: Any, options: dict[str, Any]) -> str | None:
    """``params.instruction`` → ``options.instruction`` → none; must be a string."""
    value = explicit if explicit is not None else options.get("instruction")
    if value is not None and not isinstance(value, str):
        raise invalid_input("instruction must be a string", param="instruction")
    return value or None


def truncates(options: dict[str, Any]) -> bool:
    """Whether over-long inputs are truncated (``overflow_policy`` default/truncate_text) or refused (error)."""
    policy = options.get("overflow_policy", "default")
    if policy not in OVERFLOW_POLICIES:
        raise invalid_input(
            f"overflow_policy must be one of {list(OVERFLOW_POLICIES)}, got {policy!r}", param="overflow_policy"
        )
    return bool(policy != "error")


def output_types(resolved: Resolved, options: dict[str, Any], requested: Any) -> list[str]:
    """Encode outputs: options/profile ``output_types`` → ``params.output_types`` → ``["dense"]``, checked
    against the outputs the profile can produce."""
    if resolved.config.tasks.encode is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support encoding")
    value = options.get("output_types") or requested or ["dense"]
    if not isinstance(value, list) or not value or any(t not in OUTPUT_TYPES for t in value):
        raise invalid_input(f"output_types must be a non-empty list of {list(OUTPUT_TYPES)}", param="output_types")
    supported = supported_outputs(resolved)
    unsupported = [t for t in value if t not in supported]
    if unsupported:
        raise invalid_input(
            f"Model '{resolved.routable_id}' does not support output types: {unsupported} (supported: {supported})",
            param="output_types",
        )
    return list(dict.fromkeys(value))


def output_dtype(explicit: Any, options: dict[str, Any]) -> str:
    """``params.output_dtype`` → ``options.output_dtype`` → ``float32``; must be a known dtype."""
    value = explicit or options.get("output_dtype") or "float32"
    if value not in OUTPUT_DTYPES:
        raise invalid_input(f"output_dtype must be one of {list(OUTPUT_DTYPES)}, got {value!r}", param="output_dtype")
    return value
