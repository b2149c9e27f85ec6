"""Priority classes of a request (``interactive`` or ``bulk``), one rule for the gateway and ``sie serve``.

The class names live in :mod:`protocol.subjects` (bulk work has its own subjects in the cluster);
this module decides which class a request belongs to and checks the settings that name a default.
"""

from __future__ import annotations

from protocol.errors import invalid_input
from protocol.subjects import BULK, INTERACTIVE, PRIORITIES

PRIORITY_HEADER = "X-SIE-Priority"

__all__ = ["BULK", "INTERACTIVE", "PRIORITIES", "PRIORITY_HEADER", "priority_setting", "request_priority"]


def request_priority(header: str | None, token_default: str | None, default: str) -> str:
    """The priority class of a request: ``X-SIE-Priority``, else its token's default, else ``default``
    (the gateway: its pool's default, else the gateway's; ``sie serve``: its setting). An unknown
    header value is a 400 INVALID_INPUT."""
    if header is not None and header.strip():
        value = header.strip().lower()
        if value not in PRIORITIES:
            raise invalid_input(
                f"{PRIORITY_HEADER} must be one of {list(PRIORITIES)}, got {header!r}", param=PRIORITY_HEADER
            )
        return value
    return token_default or default


def priority_setting(value: str | None, env_name: str) -> str:
    """A setting naming a default priority class, normalised; a ValueError naming ``env_name`` otherwise."""
    value = (value or "").strip().lower()
    if value not in PRIORITIES:
        raise ValueError(f"{env_name} must be one of {list(PRIORITIES)}")
    return value
