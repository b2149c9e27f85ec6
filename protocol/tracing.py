"""Tracing with OpenTelemetry: a span per hop, W3C trace context carried between processes.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set when a
process starts: then spans go over OTLP/HTTP to that endpoint (the SDK reads the other standard
``OTEL_*`` variables: headers, timeouts, batch delays, ``OTEL_SERVICE_NAME``). Off, every helper
here returns after one check of a module variable, and the OpenTelemetry packages are not imported
(they are the optional ``observe`` extra).

Trace context travels as a W3C ``traceparent`` (and ``tracestate``) string: in the HTTP request
headers from clients, in the job (protocol.jobs), and in the IPC
request envelope.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from protocol import logs

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def setup_tracing(service_name: str) -> bool:
    """Turn tracing on for this process when an OTLP endpoint is configured; True if it is on."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        logging.getLogger("sie.tracing").warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but tracing cannot start (%s): install the 'observe' extra",
            exc,
        )
        return False

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    enable(provider)
    return True


def enable(provider: Any) -> None:
    """Trace with ``provider`` (an SDK TracerProvider): used by setup_tracing, and by tests."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("sie-cluster")
    logs.trace_id_source = current_trace_id


def shutdown() -> None:
    """Flush and stop (at process exit); tracing is off afterwards."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    logs.trace_id_source = None
    if provider is not None:
        provider.shutdown()


def _context(traceparent: str | None, tracestate: str | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


_OFF: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def span(
    name: str,
    *,
    parent: str | None = None,
    parent_state: str | None = None,
    attributes: dict[str, Any] | None = None,
    start_s: float | None = None,
    links: Sequence[str] = (),
) -> contextlib.AbstractContextManager[Any]:
    """A span around the block, current inside it; the block gets None when tracing is off (a
    shared no-op context: nothing is built).

    ``parent``: a W3C traceparent to continue (else the current span, else a new trace);
    ``start_s``: when the span began (Unix seconds), for hops measured after the fact;
    ``links``: traceparents of other work the span serves (a batch of several requests).
    """
    if _tracer is None:
        return _OFF
    return _span(name, parent, parent_state, attributes, start_s, links)


@contextlib.contextmanager
def _span(
    name: str,
    parent: str | None,
    parent_state: str | None,
    attributes: dict[str, Any] | None,
    start_s: float | None,
    links: Sequence[str],
) -> Iterator[Any]:
    from opentelemetry import trace

    context = _context(parent, parent_state) if isinstance(parent, str) and parent else None
    span_links = []
    for tp in links:
        linked = trace.get_current_span(_context(tp, None)).get_span_context()
        if linked.is_valid:
            span_links.append(trace.Link(linked))
    start = int(start_s * 1e9) if start_s is not None else None
    with _tracer.start_as_current_span(
        name, context=context, attributes=attributes, links=span_links, start_time=start
    ) as current:
        yield current


def record(
    name: str, *, parent: str | None, start_s: float, end_s: float, attributes: dict[str, Any] | None = None
) -> None:
    """A finished span of an interval measured elsewhere (a queue wait: publish → pull)."""
    if _tracer is None:
        return
    context = _context(parent, None) if isinstance(parent, str) and parent else None
    s = _tracer.start_span(name, context=context, attributes=attributes, start_time=int(start_s * 1e9))
    s.end(end_time=int(max(start_s, end_s) * 1e9))


def traceparent() -> str | None:
    """The current span as a W3C traceparent, or None (tracing off, or no span)."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


def trace_id_of(traceparent: object) -> str | None:
    """The trace id of a W3C traceparent (``00-<32 hex>-<16 hex>-<2 hex>``), or None if it is not one;
    lets log lines name a client's trace even while tracing is off."""
    if not isinstance(traceparent, str):
        return None
    m = _TRACEPARENT.fullmatch(traceparent.lower())
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32:
        return None
    return m.group(2)


def current_trace_id() -> str | None:
    if _tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def set_attributes(current: Any, **attributes: Any) -> None:
    """Add attributes to a span from :func:`span` (no-op for None)."""
    if current is not None:
        current.set_attributes(attributes)
