"""``sie serve`` observed: its /metrics has the runtime's metrics, and with an OTLP endpoint a
request is a trace (serve.request continuing the client's traceparent, the worker stages under it)."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serve import ServeProcess

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from deploy.otlp_receiver import OtlpReceiver  # noqa: E402 - after the skip


def test_serve_metrics_and_trace():
    receiver = OtlpReceiver().start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "SIE_PRELOAD_MODELS": "sie-fake",
    }
    try:
        with ServeProcess(env) as serve:
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            r = httpx.post(
                serve.url + "/v1/encode/sie-fake",
                json={"items": [{"text": "a b c"}, {"text": "d"}]},
                headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            values: dict[tuple, float] = {}
            for family in text_string_to_metric_families(httpx.get(serve.url + "/metrics", timeout=10).text):
                for s in family.samples:
                    values[(s.name, tuple(sorted(s.labels.items())))] = s.value
            assert (
                values[("sie_worker_stage_seconds_count", (("model", "sie-fake"), ("stage", "inference")))]
                == 1
            )
            assert values[("sie_worker_batch_size_sum", (("model", "sie-fake"),))] == 2
            assert values[("sie_worker_loaded_models", ())] == 1
            assert any(k[0] == "sie_worker_process_cpu_seconds_total" for k in values)
            deadline = time.monotonic() + 30
            names: set[str] = set()
            while (
                time.monotonic() < deadline
                and not {"serve.request", "worker.tokenize", "worker.postprocess"} <= names
            ):
                time.sleep(0.1)
                names = {s.name for s in receiver.trace(trace_id)}
            spans = {s.name: s for s in receiver.trace(trace_id)}
            assert spans["serve.request"].parent_id == client_span
            assert spans["serve.request"].service == "sie-serve"
            for name in ("worker.tokenize", "worker.postprocess"):
                assert spans[name].parent_id == spans["serve.request"].span_id
    finally:
        receiver.stop()
