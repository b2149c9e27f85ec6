"""What ``make k8s-up`` left: the chart installed with its default images, every pod Ready."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import yaml

from tests.k8s.support import CHART, LOCAL_VALUES, REPO, Cluster

pytestmark = pytest.mark.k8s


def test_every_pod_ready_with_the_charts_images(cluster: Cluster, table):
    cluster.wait_ready(timeout_s=300)
    pods = cluster.pods()
    images = sorted({c["image"] for p in pods for c in p["spec"]["containers"]})
    # the chart's default image names; containerd pulled them from the local registry
    assert images == [
        "ghcr.io/sie-cluster/sie-config:0.10.1",
        "ghcr.io/sie-cluster/sie-gateway:0.10.1",
        "ghcr.io/sie-cluster/sie-sidecar:0.10.1",
        "ghcr.io/sie-cluster/sie-worker:0.10.1-cpu",
        "nats:2.10.22-alpine",
    ], images
    restarts = {
        p["metadata"]["name"]: sum(s["restartCount"] for s in p["status"]["containerStatuses"]) for p in pods
    }
    table.row("all pods Ready", f"{len(pods)} pods, restarts {sum(restarts.values())}, images {len(images)}")


def test_api_versions_follow_the_clusters_capabilities(cluster: Cluster, table):
    version = json.loads(cluster.run("kubectl", "version", "-o", "json"))["serverVersion"]["gitVersion"]
    assert version.startswith("v1.20."), version
    live = list(yaml.safe_load_all(cluster.helm("get", "manifest", cluster.release)))
    pdbs = {d["metadata"]["name"]: d["apiVersion"] for d in live if d and d["kind"] == "PodDisruptionBudget"}
    assert pdbs and set(pdbs.values()) == {"policy/v1beta1"}, pdbs  # 1.20 serves no policy/v1
    # the same chart for a 1.27+ cluster (what helm template assumes offline): policy/v1
    offline = list(
        yaml.safe_load_all(
            cluster.run(cluster.helm_bin, "template", "sie", str(CHART), "--kube-version", "1.29.0")
        )
    )
    assert {d["apiVersion"] for d in offline if d and d["kind"] == "PodDisruptionBudget"} == {"policy/v1"}
    # every Service port names its protocol: Helm 4's server-side apply on 1.20 needs the list key
    ports = [p for d in live if d and d["kind"] == "Service" for p in d["spec"].get("ports", [])]
    assert ports and all(p.get("protocol") == "TCP" for p in ports), ports
    table.row(
        "API versions by capability",
        f"server {version}: PDB policy/v1beta1 x{len(pdbs)}; 1.29 render: policy/v1; {len(ports)} ports with protocol",
    )


def test_config_and_nats_state_on_the_default_storage_class(cluster: Cluster, table):
    pvcs = cluster.get("pvc")["items"]
    got = {p["metadata"]["name"]: (p["status"]["phase"], p["spec"].get("storageClassName")) for p in pvcs}
    assert got == {"sie-config-state": ("Bound", "local-path"), "data-sie-nats-0": ("Bound", "local-path")}, (
        got
    )
    table.row("storage (default class)", ", ".join(f"{k} {v[0]}" for k, v in sorted(got.items())))


def test_worker_probes_and_the_shared_socket(cluster: Cluster, table):
    pod = cluster.pod_names("worker")[0]
    # the probe's command exists in the worker image and passes (it is what kubelet runs)
    cluster.kubectl("exec", pod, "-c", "worker", "--", "sie-probe", "--require-ready")
    # the sidecar sees the worker's socket in the shared volume
    out = cluster.kubectl(
        "exec", pod, "-c", "sidecar", "--", "python", "-c",
        "import os, stat; p = os.environ['SIE_IPC_SOCKET_PATH']; print(p, stat.S_ISSOCK(os.stat(p).st_mode))",
    )  # fmt: skip
    assert out.split()[-1] == "True", out
    sts = cluster.get("statefulset", pod.rsplit("-", 1)[0])
    probes = {
        c["name"]: sorted(k for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c)
        for c in sts["spec"]["template"]["spec"]["containers"]
    }
    assert probes["worker"] == ["livenessProbe", "readinessProbe", "startupProbe"], probes
    table.row(
        "worker probes + IPC socket", f"{pod}: sie-probe --require-ready ok; sidecar sees {out.split()[0]}"
    )


def test_local_values_only_change_what_the_node_needs(table):
    """The harness's values: the node port (and, since it exposes the gateway, token auth),
    requests that fit 2 cores, and a pool at zero."""
    values = yaml.safe_load(LOCAL_VALUES.read_text())
    assert set(values) == {"auth", "gateway", "config", "nats", "machineProfiles", "workers"}
    assert values["auth"] == {"mode": "token"}  # a generated token; NATS users, policies: the defaults
    assert "image" not in values["gateway"] and "global" not in values  # default images
    table.row(
        "chart defaults kept",
        "local values: node port 30080 with token auth, 2-core requests, cpu-spare at 0; images default",
    )


def registry_layers(name: str, tag: str) -> list[str]:
    r = httpx.get(
        f"http://127.0.0.1:15000/v2/{name}/manifests/{tag}",
        headers={
            "Accept": "application/vnd.oci.image.manifest.v1+json, "
            "application/vnd.docker.distribution.manifest.v2+json"
        },
        timeout=30,
    )
    r.raise_for_status()
    return [layer["digest"] for layer in r.json()["layers"]]


def test_images_share_layers_and_leave_the_venv_out(table):
    """The three service images differ in their last layer only; no build context carries .venv."""
    layers = {s: registry_layers(f"sie-cluster/sie-{s}", "0.10.1") for s in ("gateway", "sidecar", "config")}
    shared = set.intersection(*(set(v[:-1]) for v in layers.values()))
    assert all(set(v[:-1]) == shared for v in layers.values()), layers
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".venv312", ".git"} <= set(ignored)
    sizes = ""
    report = Path(os.environ.get("SIE_K8S_CACHE", "/var/cache/sie-k8s")) / "images.tsv"
    if report.exists():
        rows = [line.split("\t") for line in report.read_text().splitlines() if line.strip()]
        sizes = "; ".join(
            f"{n.rsplit('/', 1)[-1]} {int(b) / 2**20:.0f} MiB {float(t):.0f} s" for n, b, t in rows
        )
    table.row("images", f"service images share {len(shared)} layers; {sizes}")
