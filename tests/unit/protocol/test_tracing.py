"""protocol.tracing: off (the default) costs one check and imports nothing; on, spans continue the
W3C context they are given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protocol import ipc, logs, tracing
from protocol.jobs import TokenizeJob
from protocol.params import TokenizeOptions
from protocol.work_codec import decode_job, encode_job

REPO = Path(__file__).resolve().parents[3]


def test_off_by_default_and_free():
    """Without OTEL_EXPORTER_OTLP_ENDPOINT no OpenTelemetry module is even imported by a process
    that sets tracing up and runs the hooks of a request."""
    code = (
        "import sys\n"
        "from protocol import tracing\n"
        "import gateway.core, sidecar.lane, worker.ipc.server\n"
        "assert tracing.setup_tracing('x') is False\n"
        "with tracing.span('a', parent='00-' + '1' * 32 + '-' + '2' * 16 + '-01') as s:\n"
        "    assert s is None and tracing.traceparent() is None\n"
        "tracing.record('b', parent=None, start_s=0, end_s=1)\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr


def test_jobs_and_envelopes_carry_trace_context_only_when_there_is_one():
    fields = dict(request_id="r", model_id="m", profile_id="default", pool_name="default", machine_profile="cpu",
                  router_id="gw", reply_subject="_INBOX.x", timestamp=1.0, total_items=1,
                  params=TokenizeOptions(options={}, add_special_tokens=True))  # fmt: skip
    assert b"traceparent" not in encode_job(TokenizeJob(**fields))
    assert "traceparent" not in ipc.request_envelope(ipc.RUN_BATCH, "1", {})
    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert decode_job(encode_job(TokenizeJob(**fields, traceparent=tp))).traceparent == tp
    assert ipc.request_envelope(ipc.RUN_BATCH, "1", {}, traceparent=tp)["traceparent"] == tp


@pytest.fixture
def exporter():
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.enable(provider)
    yield memory
    tracing.shutdown()


def test_spans_continue_the_given_context(exporter):
    trace_id, parent = "c" * 32, "d" * 16
    with tracing.span("hop", parent=f"00-{trace_id}-{parent}-01", attributes={"items": 2}) as s:
        assert s is not None
        inner = tracing.traceparent()
        assert logs.bound()["trace_id"] == trace_id  # JSON log lines carry the trace id
        with tracing.span("child"):
            pass
    tracing.record("waited", parent=inner, start_s=100.0, end_s=100.25)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert format(spans["hop"].context.trace_id, "032x") == trace_id
    assert format(spans["hop"].parent.span_id, "016x") == parent
    assert spans["child"].parent.span_id == spans["hop"].context.span_id
    assert spans["waited"].parent.span_id == spans["hop"].context.span_id
    assert spans["waited"].end_time - spans["waited"].start_time == 250_000_000
    assert inner is not None and inner.split("-")[1] == trace_id


def test_garbage_context_starts_a_new_trace(exporter):
    with tracing.span("hop", parent="not a traceparent", links=["nope", "00-zz-yy-01"]):
        pass
    tracing.record("rec", parent=12345, start_s=1.0, end_s=0.5)  # type: ignore[arg-type]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["hop"].parent is None and not spans["hop"].links
    assert spans["rec"].parent is None and spans["rec"].end_time == spans["rec"].start_time


@pytest.mark.parametrize(
    "value, expected",
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-00", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # invalid all-zero id
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # forbidden version
        ("00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", None),  # not hex
        ("00-4bf92f3577b34da6a3ce929d0e0e_736-00f067aa0ba902b7-01", None),  # int() would take the _
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", None),
        ("", None),
        (None, None),
        (42, None),
        ("x" * 55, None),
    ],
)
def test_trace_id_of_a_client_traceparent(value, expected):
    assert tracing.trace_id_of(value) == expected


def test_an_endpoint_without_the_packages_leaves_tracing_off(tmp_path):
    """OTEL_EXPORTER_OTLP_ENDPOINT set where the observe extra is missing: a warning, no crash."""
    blocker = tmp_path / "opentelemetry"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('opentelemetry hidden for this test')\n")
    code = (
        "from protocol import tracing\nassert tracing.setup_tracing('x') is False and not tracing.enabled()\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{tmp_path}:{REPO}",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
    }
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert "install the 'observe' extra" in res.stderr
