"""Scale from zero through the gateway's scaler, ``helm upgrade`` under load, ``helm test``."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.k8s.support import CHART, MINILM, Cluster, log, run_load
from tests.support.sdk312 import run_sdk

pytestmark = pytest.mark.k8s

SPARE = "sie-w-default-cpu-spare"


def replicas(cluster: Cluster, sts: str) -> int:
    return int(cluster.get("statefulset", sts)["spec"].get("replicas") or 0)


def test_scale_from_zero_through_the_gateways_scaler(cluster: Cluster, sdk, table):
    cluster.wait_ready()
    assert replicas(cluster, SPARE) == 0
    gateway = cluster.get("deployment", f"{cluster.release}-gateway")["spec"]["template"]["spec"]
    sa = f"system:serviceaccount:{cluster.namespace}:{gateway['serviceAccountName']}"
    # the chart's Role lets the gateway's ServiceAccount scale its worker StatefulSets, nothing more
    can = cluster.kubectl(
        "auth", "can-i", "patch", f"statefulsets.apps/{SPARE}", "--subresource=scale", "--as", sa
    )
    assert can.strip() == "yes"
    cannot = cluster.kubectl("auth", "can-i", "delete", "pods", "--as", sa, check=False)
    assert cannot.strip() == "no"
    t0 = time.monotonic()
    out = run_sdk(
        f"""
        import time
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import ProvisioningError
        res = {{}}
        with SIEClient(URL) as c:
            try:
                c.encode({MINILM!r}, {{"text": "x"}}, gpu="cpu-spare", wait_for_capacity=False)
                res["first"] = "no error"
            except ProvisioningError as e:
                res["first"] = ["ProvisioningError", e.retry_after]
            t = time.monotonic()
            r = c.encode({MINILM!r}, {{"text": "x"}}, gpu="cpu-spare", provision_timeout_s=600)
            res["shape"] = list(r["dense"].shape)
            res["retries"] = c.last_retry_count
            res["waited_s"] = time.monotonic() - t
        print(json.dumps(res))
        """,
        cluster.gateway_url,
        timeout=900,
    )
    assert out["first"][0] == "ProvisioningError" and out["first"][1], out
    assert out["shape"] == [384] and out["retries"] >= 1, out
    assert replicas(cluster, SPARE) == 1
    logs = "".join(cluster.kubectl("logs", p, "-c", "gateway") for p in cluster.pod_names("gateway"))
    assert f"scaled {cluster.namespace}/{SPARE} from 0 to 1" in logs
    # its pod runs two model processes (deploy/k8s-local/values.yaml), each a worker of its own
    spare = {f"{SPARE}-0", f"{SPARE}-0-p1"}
    deadline = time.monotonic() + 180  # generous: the second process loads the model on its own
    while time.monotonic() < deadline:
        health = httpx.get(cluster.gateway_url + "/health", headers=cluster.headers(), timeout=10).json()
        healthy = {w["url"].removeprefix("nats:") for w in health["workers"] if w["healthy"]}
        if spare <= healthy:
            break
        time.sleep(2)
    assert spare <= healthy, health["workers"]
    table.row(
        "scale from zero (gateway scaler, chart RBAC)",
        f"PROVISIONING, then {SPARE} 0 -> 1 by the gateway; served after {out['waited_s']:.1f} s, "
        f"{out['retries']} SDK retries",
    )
    cluster.wait_ready()
    log(f"scale from zero done in {time.monotonic() - t0:.0f} s")


def test_helm_upgrade_under_load_fails_no_request(cluster: Cluster, sdk, table):
    cluster.wait_ready()
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods()}
    values = cluster.helm("get", "values", cluster.release, "-o", "json")
    new_format = "json" if '"logFormat":"json"' not in values.replace(" ", "") else "text"

    def upgrade() -> None:
        cluster.helm(
            "upgrade", cluster.release, str(CHART), "--reuse-values",
            "--set", f"logFormat={new_format}", "--wait", "--timeout", "15m",
        )  # fmt: skip
        cluster.wait_ready()

    res = run_load(cluster.gateway_url, upgrade, total=0, threads=4, pace_s=0.2, signal_at=20)
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods()}
    replaced = sum(1 for name, uid in before.items() if after.get(name) != uid)
    table.row(
        "helm upgrade under load",
        f"logFormat -> {new_format}: {replaced} of {len(before)} pods replaced; " + res.summary(),
    )
    assert replaced >= len(before) - 1  # every pod whose settings changed (NATS takes no log format)
    assert res.failed == 0 and res.wrong == 0, res.errors


def test_helm_test_hook_encodes_through_the_gateway(cluster: Cluster, table):
    cluster.wait_ready()
    out = cluster.helm("test", cluster.release, "--timeout", "10m")
    assert "Phase:          Succeeded" in out or "Succeeded" in out, out
    table.row(
        "helm test", "encode hook: " + " ".join(line.strip() for line in out.splitlines() if "Phase" in line)
    )
