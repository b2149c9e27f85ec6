"""A small OTLP/HTTP trace receiver: ``POST /v1/traces`` (protobuf, as the SDK exporter sends it).

``sie up --observe`` runs one in the launcher's process and points every child at it, printing one
line per finished request trace; tests use it to see the spans the processes really export. Needs
the ``observe`` extra (opentelemetry-proto comes with the exporter).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


def missing_packages() -> str:
    """What of the observe extra is not installed ("" when all is)."""
    import importlib.util

    needed = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.proto")
    missing = []
    for name in needed:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return ", ".join(missing)


def decode(body: bytes) -> list[Span]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        service=str(service),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                    )
                )
    return out


class OtlpReceiver:
    """Collects spans in memory (``spans``) and calls ``on_spans`` with each export's spans."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, on_spans: Callable[[list[Span]], None] | None = None
    ) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.on_spans = on_spans
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                if self.path != "/v1/traces" or not 0 < length <= MAX_BODY_BYTES:
                    self.send_error(404 if self.path != "/v1/traces" else 413)
                    return
                try:
                    spans = decode(self.rfile.read(length))
                except Exception:  # noqa: BLE001 - a bad body is the client's problem
                    self.send_error(400)
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                if receiver.on_spans is not None:
                    receiver.on_spans(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def print_spans(spans: list[Span], say: Callable[[str], None] = print) -> None:
    """One line per span: trace id, service, name, duration; a request's own span stands out."""
    for s in sorted(spans, key=lambda s: s.start_ns):
        mark = "▶" if s.name.endswith(".request") or not s.parent_id else " "
        say(f"{mark} trace {s.trace_id[:16]} {s.service:<12} {s.name:<28} {s.ms:9.2f} ms")
