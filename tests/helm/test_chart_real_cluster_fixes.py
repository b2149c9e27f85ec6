"""What the first install on a real node (``make e2e-k8s``) found wrong in the chart and the
images, pinned here without a cluster so ``make test`` keeps it fixed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helm.conftest import CHART

REPO = CHART.parents[1]


def test_every_port_names_its_protocol(render):
    """Helm 4's server-side apply on 1.20 refuses a port list entry without ``protocol``."""
    docs = render.template()
    ports = [p for d in docs if d["kind"] == "Service" for p in d["spec"].get("ports", [])]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Pod"):
            spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
            ports += [p for c in spec["containers"] for p in c.get("ports", [])]
    assert ports and all(p.get("protocol") == "TCP" for p in ports), ports


def test_installs_on_1_20_and_picks_the_pdb_api_by_capability(render):
    res = render.run("template", "sie", str(CHART), "--kube-version", "1.20.2")
    assert res.returncode == 0, res.stderr
    pdbs = [d for d in render.template() if d["kind"] == "PodDisruptionBudget"]
    assert pdbs and {d["apiVersion"] for d in pdbs} == {"policy/v1"}  # Helm's offline list has it
    tpl = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'Capabilities.APIVersions.Has "policy/v1"' in tpl and "policy/v1beta1" in tpl


def test_gateway_and_sidecar_read_the_registry_from_this_releases_config_service(render):
    for release, config in (("sie", "sie-config"), ("prod", "prod-sie-cluster-config")):
        docs = render.template(release=release, namespace="ml")
        by_name = {c["name"]: c for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                   for c in d["spec"]["template"]["spec"]["containers"]}  # fmt: skip
        for name in ("gateway", "sidecar"):
            env = {e["name"]: e for e in by_name[name]["env"]}
            assert env["SIE_CONFIG_SERVICE_URL"]["value"] == f"http://{config}.ml.svc:8090"
            ref = env["SIE_CONFIG_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == "SIE_CONFIG_READ_TOKEN"
        cfg = {e["name"]: e.get("value") for e in by_name["config"]["env"]}
        # the image's source tree is /app (deploy/docker/): the catalog the worker loads
        for key, folder in (("SIE_BUNDLES_DIR", "bundles"), ("SIE_MODELS_DIR", "models")):
            assert cfg[key] == f"/app/worker/catalog/{folder}"
            assert list((REPO / "worker" / "catalog" / folder).glob("*.yaml"))


def test_helm_test_hook_goes_once_it_passes(render):
    pods = [d for d in render.template() if d["kind"] == "Pod"]
    assert [p["metadata"]["annotations"]["helm.sh/hook"] for p in pods] == ["test"]
    policy = pods[0]["metadata"]["annotations"]["helm.sh/hook-delete-policy"].split(",")
    assert "hook-succeeded" in policy  # helm uninstall never deletes hooks
    assert not [d for d in render.template(sets={"tests.enabled": "false"}) if d["kind"] == "Pod"]


def test_service_images_share_every_layer_but_the_last():
    lines = Path(REPO / "deploy" / "docker" / "Dockerfile.service").read_text().splitlines()
    arg = next(i for i, line in enumerate(lines) if line.startswith("ARG SERVICE"))
    assert arg > max(i for i, line in enumerate(lines) if re.match(r"RUN .*pip install", line))
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".venv312"} <= set(ignored)
