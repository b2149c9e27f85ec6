"""One logging setup for every process: plain text, or one JSON object per line.

``SIE_LOG_FORMAT=json`` (each process's ``log_format`` setting) makes every record a JSON object
with ``ts``, ``level``, ``logger``, ``msg`` and, when known, ``request_id`` and ``trace_id``; an
exception adds ``exc``. The ids come from :func:`bind` (a context variable, so they follow the
asyncio task that handles a request) and, for ``trace_id``, from the active OpenTelemetry span when
tracing is on (see :mod:`protocol.tracing`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
from collections.abc import Callable, Iterator

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_fields: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "sie_log_fields", default=None
)

# Set by protocol.tracing when tracing is on: the current span's trace id (32 hex), or None.
trace_id_source: Callable[[], str | None] | None = None


@contextlib.contextmanager
def bind(**fields: str | None) -> Iterator[None]:
    """Attach ``fields`` (request_id, trace_id, …) to every record logged inside the block."""
    current = _fields.get() or {}
    token = _fields.set({**current, **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _fields.reset(token)


def bound() -> dict[str, str]:
    """The fields bound in the current context, with the active span's trace id when there is one."""
    out = dict(_fields.get() or {})
    if "trace_id" not in out and trace_id_source is not None:
        trace_id = trace_id_source()
        if trace_id:
            out["trace_id"] = trace_id
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC ISO 8601), level, logger, msg, bound ids, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(bound())
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Configure the root logger of a process (replaces handlers set before)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
