"""One encode through a launcher-started cluster is one connected trace, with every hop in it.

The cluster is started the way ``sie up --observe`` starts it: the launcher runs a real OTLP/HTTP
receiver (deploy.otlp_receiver) in this process and every child exports its spans to it; the
client sends a W3C traceparent, which the gateway continues. The worker pod's metrics port is on.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from pathlib import Path

import httpx
import pytest

from deploy.launcher import Cluster
from tests.support.cluster import wait_for_worker
from tests.support.nats_server import free_port

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deploy.otlp_receiver import OtlpReceiver  # noqa: E402 - after the skip

HOPS = {
    "gateway.request": "sie-gateway",
    "gateway.publish": "sie-gateway",
    "gateway.collect": "sie-gateway",
    "sidecar.queue_wait": "sie-sidecar",
    "sidecar.batch_formation": "sie-sidecar",
    "sidecar.run_batch": "sie-sidecar",
    "worker.RunBatch": "sie-worker",
    "worker.tokenize": "sie-worker",
    "worker.forward": "sie-worker",
    "worker.postprocess": "sie-worker",
    "sidecar.result_publish": "sie-sidecar",
}


@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory):
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("SIE_", "OTEL_"))}
    os.environ.update(
        {
            "SIE_HF_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "SIE_TORCH_THREADS": "1",
            "SIE_STREAM_STORAGE": "memory",
            "SIE_HEALTH_PUBLISH_INTERVAL_MS": "1000",
            "SIE_LOG_FORMAT": "json",
        }
    )
    printed: list[str] = []
    c = Cluster(
        Path(tmp_path_factory.mktemp("traced")),
        free_port(),
        free_port(),
        free_port(),
        preload="sie-fake",
        observe=True,
        otlp_port=free_port(),
        metrics_port=free_port(),
        say_spans=printed.append,
    )
    try:
        c.start(say=lambda *_: None)
        wait_for_worker(c.gateway_url)
        assert isinstance(c.receiver, OtlpReceiver)
        yield c, c.receiver, printed
    finally:
        c.stop()
        for _, proc in c.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for k in [k for k in os.environ if k.startswith(("SIE_", "OTEL_"))]:
            del os.environ[k]
        os.environ.update(saved)


def wait_for_hops(receiver: OtlpReceiver, trace_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    spans = []
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        names = [s.name for s in spans]
        forwarded = sum(s.attributes.get("batch_size", 0) for s in spans if s.name == "worker.forward")
        # a result goes alone, or with others of its batch in one message (one span, ``items`` of them)
        published = sum(s.attributes.get("items", 1) for s in spans if s.name == "sidecar.result_publish")
        if set(HOPS) <= set(names) and published == 3 and forwarded == 3:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"hops missing: {set(HOPS) - {s.name for s in spans}}")


def test_an_encode_is_one_trace_with_every_hop(traced_cluster):
    cluster, receiver, printed = traced_cluster
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(
        cluster.gateway_url + "/v1/encode/sie-fake",
        json={"items": [{"text": "one"}, {"text": "two two"}, {"text": "three three three"}]},
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    spans = wait_for_hops(receiver, trace_id)
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "gateway.request"]
    assert root.parent_id == client_span  # the client's traceparent was continued
    assert root.attributes["model"] == "sie-fake" and root.attributes["items"] == 3
    assert root.attributes["pool"] == "default" and root.attributes["machine_profile"] == "cpu"
    assert root.attributes["profile"] and root.attributes["request_id"] == r.headers["X-SIE-Request-ID"]
    for s in spans:
        assert s.service == HOPS.get(s.name, s.service), (s.name, s.service)
        if s is root:
            continue
        # every other span descends from the gateway's request span
        node, seen = s, 0
        while node.parent_id != root.span_id:
            assert node.parent_id in by_id, f"{s.name} is not connected to the gateway span"
            node, seen = by_id[node.parent_id], seen + 1
            assert seen < 10
    names = [s.name for s in spans]
    # the three items travelled in one message (one queue wait) and each joined a batch
    (wait,) = [s for s in spans if s.name == "sidecar.queue_wait"]
    assert wait.attributes["items"] == 3 and names.count("sidecar.batch_formation") == 3
    # the sidecar may have formed one batch or several: together they ran the three items
    forwards = [s for s in spans if s.name == "worker.forward"]
    assert sum(f.attributes["batch_size"] for f in forwards) == 3
    for forward in forwards:
        assert forward.attributes["tokens"] > 0 and 0 <= forward.attributes["padding_share"] < 1
        assert by_id[forward.parent_id].name == "worker.RunBatch"
        assert by_id[by_id[forward.parent_id].parent_id].name == "sidecar.run_batch"
    # what `sie up --observe` prints: a line per span, the request's root marked
    mine = [line for line in printed if trace_id[:16] in line]
    assert any(line.startswith("▶") and "gateway.request" in line for line in mine)
    assert any("worker.forward" in line and "sie-worker" in line for line in mine)


def test_a_request_without_traceparent_starts_its_own_trace(traced_cluster):
    cluster, receiver, _ = traced_cluster
    before = len(receiver.spans)
    r = httpx.post(
        cluster.gateway_url + "/v1/encode/sie-fake", json={"items": [{"text": "alone"}]}, timeout=60
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    roots = []
    while time.monotonic() < deadline and not roots:
        roots = [
            s
            for s in receiver.spans[before:]
            if s.name == "gateway.request" and s.attributes.get("request_id") == r.headers["X-SIE-Request-ID"]
        ]
        time.sleep(0.1)
    (root,) = roots
    assert root.parent_id == ""
    wait_until = time.monotonic() + 60
    while time.monotonic() < wait_until and "worker.forward" not in {
        s.name for s in receiver.trace(root.trace_id)
    }:
        time.sleep(0.1)
    assert "worker.forward" in {s.name for s in receiver.trace(root.trace_id)}


def test_the_pod_metrics_port_serves_sidecar_and_worker(traced_cluster):
    cluster, _, _ = traced_cluster
    r = httpx.post(
        cluster.gateway_url + "/v1/encode/sie-fake", json={"items": [{"text": "metrics"}]}, timeout=60
    )
    assert r.status_code == 200, r.text
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    assert values["sie_sidecar_worker_metrics_up"] == 1
    assert values["sie_sidecar_deliveries_total"] >= 1 and values["sie_worker_loaded_models"] == 1
    assert values["sie_worker_stage_seconds_count"] >= 1 and "sie_sidecar_lane_pending" in values


def test_every_process_logs_json_lines(traced_cluster):
    cluster, _, _ = traced_cluster
    for name in ("config", "worker", "sidecar", "gateway"):
        lines = (cluster.state_dir / "logs" / f"{name}.log").read_text().splitlines()
        assert lines, name
        for line in lines:
            record = json.loads(line)
            assert {"ts", "level", "logger", "msg"} <= set(record), (name, line)
