"""The chart's dashboards, alert rules and scrape configs name only metrics the code exports.

The exported names come from the code's own registries, built as the processes build them (a
real gateway/config/worker/sidecar metrics object); every dashboard panel query and alert
expression is parsed as PromQL (promql-parser) and each metric it selects must be among them.
"""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry

from config_service.metrics import ConfigMetrics
from gateway.metrics import GatewayMetrics
from sidecar.ipc_client import IpcClient
from sidecar.lane import LaneConsumer
from sidecar.settings import SidecarSettings
from worker.runtime import Runtime
from worker.serve.metrics import ServeMetrics
from worker.settings import WorkerSettings

promql_parser = pytest.importorskip("promql_parser")

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
DASHBOARDS = {"sie-overview.json", "sie-pools.json", "sie-models.json", "sie-resources.json"}


def series_names(registry: CollectorRegistry) -> set[str]:
    out = set()
    for family in registry.collect():
        out.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return out


@pytest.fixture(scope="module")
def exported() -> set[str]:
    names = series_names(GatewayMetrics().registry) | series_names(ConfigMetrics().registry)
    names |= series_names(ServeMetrics().registry)
    runtime = Runtime(WorkerSettings())
    names |= series_names(runtime.metrics.registry)
    lane = LaneConsumer(NATS(), IpcClient("/nonexistent.sock"), SidecarSettings())
    names |= series_names(lane.metrics.registry)
    return names


def selected_metrics(expr: str) -> set[str]:
    """Metric names the PromQL expression selects (parse errors fail the test)."""
    p = promql_parser
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, p.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"selector without a metric name in {expr!r}"
            found.add(name)
        elif isinstance(node, p.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, p.BinaryExpr):
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, (p.AggregateExpr, p.ParenExpr, p.UnaryExpr, p.SubqueryExpr)):
            walk(node.expr)
            if isinstance(node, p.AggregateExpr) and node.param is not None:
                walk(node.param)
        elif isinstance(node, p.Call):
            for arg in node.args:
                walk(arg)
        else:
            assert isinstance(node, (p.NumberLiteral, p.StringLiteral)), type(node)

    walk(p.parse(expr))
    return found


def test_the_checker_sees_every_selector_and_refuses_bad_promql():
    assert selected_metrics(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=~"$m"}[5m]))) / on() b - -c and d offset 5m'
    ) == {"a_bucket", "b", "c", "d"}
    assert selected_metrics("max_over_time(e[10m:1m]) > topk(3, f)") == {"e", "f"}
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type
        selected_metrics("sum(rate(x[5m])")


def test_the_registries_are_the_real_ones(exported):
    # spot checks, so an empty or partial set cannot pass the tests below
    for name in (
        "sie_gateway_requests_total",
        "sie_config_epoch",
        "sie_worker_stage_seconds_bucket",
        "sie_worker_evictions_total",
        "sie_sidecar_lane_pending",
        "sie_sidecar_deliveries_total",
        "sie_worker_process_cpu_seconds_total",
        "sie_sidecar_process_resident_memory_bytes",
    ):
        assert name in exported


@pytest.fixture(scope="module")
def observed(render) -> list[dict]:
    return render.template(
        crds=True,
        sets={"dashboards.enabled": "true", "alerts.enabled": "true", "serviceMonitor.enabled": "true"},
    )


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def test_every_dashboard_query_names_an_exported_metric(observed, exported):
    (cm,) = [d for d in kinds(observed, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    assert set(cm["data"]) == DASHBOARDS
    queries = 0
    for file, text in cm["data"].items():
        dash = json.loads(text)
        for panel in dash["panels"]:
            assert panel["targets"], f"{file}: panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                names = selected_metrics(target["expr"])
                assert names, f"{file}: {target['expr']!r} selects no metric"
                unknown = names - exported
                assert not unknown, f"{file}: panel {panel['title']!r} uses {sorted(unknown)}"
                queries += 1
        for var in dash["templating"]["list"]:
            if var["type"] == "query":  # label_values(metric, label)
                metric = var["query"].split("(", 1)[1].split(",", 1)[0].strip()
                assert metric in exported, f"{file}: variable {var['name']} reads {metric}"
    assert queries >= 30


def test_every_alert_expression_names_an_exported_metric(observed, exported):
    (rule,) = kinds(observed, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "SIELaneBacklogGrowing",
        "SIEWorkerHeartbeatsMissing",
        "SIEDeadLetters",
        "SIEErrorRatioHigh",
        "SIELatencyP99OverObjective",
        "SIEModelLoadFailures",
        "SIEEvictionLoop",
    } <= set(alerts)
    for name, r in alerts.items():
        names = selected_metrics(r["expr"])
        assert names and not names - exported, f"{name}: {sorted(names - exported)}"
        assert r["labels"]["severity"] in ("warning", "critical")


def test_alert_thresholds_come_from_values(render, tmp_path):
    values = tmp_path / "alerts.yaml"  # a file: --set would pass the numbers as strings
    values.write_text(
        "alerts: {enabled: true, p99LatencySeconds: 0.75, errorRatio: 0.2, alertLabels: {team: search}}"
    )
    docs = render.template(str(values), crds=True)
    (rule,) = kinds(docs, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts["SIELatencyP99OverObjective"]["expr"].endswith("> 0.75")
    assert alerts["SIEErrorRatioHigh"]["expr"].endswith("> 0.2")
    assert all(r["labels"]["team"] == "search" for r in alerts.values())


def test_rules_are_off_by_default(render):
    assert not kinds(render.template(crds=True), "PrometheusRule")


def test_worker_pods_are_scraped_on_the_sidecar_metrics_port(observed):
    (pm,) = kinds(observed, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    endpoint, *more = pm["spec"]["podMetricsEndpoints"]
    assert not more  # CPU pods only: one process each, one metrics port
    targets = {r["targetLabel"] for r in endpoint["relabelings"]}
    assert targets == {"pool", "machine_profile", "bundle"}
    workers = [
        d
        for d in kinds(observed, "StatefulSet")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    assert workers
    for sts in workers:
        pod = sts["spec"]["template"]
        for k, v in pm["spec"]["selector"]["matchLabels"].items():
            assert pod["metadata"]["labels"][k] == v
        (sidecar,) = [c for c in pod["spec"]["containers"] if c["name"] == "sidecar"]
        (port,) = [p for p in sidecar["ports"] if p["name"] == endpoint["port"]]
        env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert env["SIE_METRICS_PORT"] == str(port["containerPort"])
        assert SidecarSettings.model_fields["metrics_port"].default == 0  # off unless the chart sets it


def test_log_format_reaches_every_container(render):
    docs = render.template(sets={"logFormat": "json"})
    containers = [
        c
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] != "nats"
    ]
    assert {c["name"] for c in containers} >= {"gateway", "sidecar", "worker", "config"}
    for c in containers:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("SIE_LOG_FORMAT") == "json", c["name"]


def test_tracing_values_point_the_request_path_at_the_collector(render):
    assert not any(
        e["name"].startswith("OTEL_")
        for d in render.template()
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    )
    docs = render.template(
        sets={"tracing.enabled": "true", "tracing.otlpEndpoint": "http://otel.monitoring:4318"}
    )
    containers = [
        c
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] != "nats"
    ]
    for c in containers:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if c["name"] == "config":  # not on the request path: no spans
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
        else:
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel.monitoring:4318", c["name"]
    res = render.template_raw(sets={"tracing.enabled": "true"})
    assert res.returncode != 0 and "tracing.otlpEndpoint" in res.stderr
