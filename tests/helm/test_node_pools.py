"""The install guides and the chart agree (issue 14): every pod the chart renders with each values
file lands on a node pool the guide creates (``deploy/docs/node-pools.yaml``, the one source of
the guides' commands); EKS gets the gp3 StorageClass the chart asks for; the cluster weight cache
is a chart value the guides set, with the credentials they describe; ``helm install sie`` names
resources ``sie-*``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deploy.node_pools import blocks, load, node_labels, node_taints

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "deploy" / "docs"
WORKLOADS = ("Deployment", "StatefulSet")


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and str(t.get("value", "")) == taint["value"]:
            return True
    return False


def pools_for(cloud: str, spec: dict, with_optional: bool) -> list[str]:
    """The pools whose nodes would take a pod with this spec (labels match, every taint tolerated)."""
    selector = spec.get("nodeSelector") or {}
    tolerations = spec.get("tolerations") or []
    fits = []
    for pool in load()[cloud]["pools"]:
        if pool.get("optional") and not with_optional:
            continue
        labels = node_labels(cloud, pool)
        if all(labels.get(k) == str(v) for k, v in selector.items()) and all(
            tolerates(tolerations, t) for t in node_taints(cloud, pool)
        ):
            fits.append(pool["name"])
    return fits


def test_the_guides_show_the_pools_of_the_data_file():
    for guide, block in blocks().items():
        text = (DOCS / guide).read_text()
        start = text.index("<!-- node-pools:start -->") + len("<!-- node-pools:start -->")
        assert text[start : text.index("<!-- node-pools:end -->")].strip() == block, (
            f"{guide}: run python -m deploy.node_pools and paste its block"
        )


CASES = {
    "gke": ("gke", ["values-gke.yaml"], {}, False),
    "gke+large": ("gke", ["values-gke.yaml"], {"workers.pools.large.enabled": "true"}, True),
    "eks": ("eks", ["values-eks.yaml"], {}, False),
    "default-on-gke": ("gke", [], {}, False),
    "default-on-eks": ("eks", [], {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_pod_lands_on_a_pool_the_guide_creates(render, case):
    cloud, files, sets, optional = CASES[case]
    docs = render.template(*files, crds=True, sets=sets)
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    assert any("-w-" in d["metadata"]["name"] for d in workloads)
    homeless = {
        d["metadata"]["name"]: (
            d["spec"]["template"]["spec"].get("nodeSelector"),
            d["spec"]["template"]["spec"].get("tolerations"),
        )
        for d in workloads
        if not pools_for(cloud, d["spec"]["template"]["spec"], optional)
    }
    assert not homeless, f"pods no {cloud} node pool of deploy/docs/node-pools.yaml takes: {homeless}"


def test_each_gpu_profile_has_its_own_pool_and_spot_stays_on_spot(render):
    docs = render.template("values-gke.yaml", crds=True, sets={"workers.pools.large.enabled": "true"})
    where = {
        d["metadata"]["name"]: pools_for("gke", d["spec"]["template"]["spec"], True)
        for d in docs
        if d["kind"] == "StatefulSet" and "-w-" in d["metadata"]["name"]
    }
    assert where == {
        "sie-w-default-cpu": ["default-pool"],
        "sie-w-default-l4": ["l4"],
        "sie-w-default-l4-spot": ["l4-spot"],
        "sie-w-large-a100-80gb": ["a100-80gb"],
    }


def test_eks_guide_creates_the_storage_class_the_chart_uses(render):
    docs = render.template("values-eks.yaml", crds=True)
    classes = {
        c["spec"]["storageClassName"] for c in (d for d in docs if d["kind"] == "PersistentVolumeClaim")
    }
    for d in docs:
        if d["kind"] == "StatefulSet":
            classes |= {t["spec"].get("storageClassName") for t in d["spec"].get("volumeClaimTemplates", [])}
    classes.discard(None)
    assert classes, "values-eks.yaml stores NATS and the config service on PVCs"
    sc = yaml.safe_load((DOCS / "eks-gp3-storageclass.yaml").read_text())
    assert sc["kind"] == "StorageClass" and classes == {sc["metadata"]["name"]}
    guide = (DOCS / "install-eks.md").read_text()
    assert sc["provisioner"] == "ebs.csi.aws.com" and "--name aws-ebs-csi-driver" in guide
    assert "kubectl apply -f deploy/docs/eks-gp3-storageclass.yaml" in guide


def _worker_env(docs: list[dict]) -> list[dict[str, str]]:
    out = []
    for d in docs:
        if d["kind"] == "StatefulSet" and "-w-" in d["metadata"]["name"]:
            worker = next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
            out.append({e["name"]: e.get("value") for e in worker.get("env", [])})
    return out


@pytest.mark.parametrize(
    "guide,values,annotation",
    [
        ("install-gke.md", "values-gke.yaml", "iam.gke.io/gcp-service-account"),
        ("install-eks.md", "values-eks.yaml", "eks.amazonaws.com/role-arn"),
    ],
)
def test_the_guides_cluster_cache_reaches_the_workers_with_their_identity(render, guide, values, annotation):
    text = (DOCS / guide).read_text()
    (url,) = re.findall(r"--set workers\.clusterCache\.url=(\S+)", text)
    docs = render.template(values, crds=True, sets={"workers.clusterCache.url": url})
    envs = _worker_env(docs)
    assert envs and all(e["SIE_CLUSTER_CACHE_URL"] == url for e in envs)
    assert all("SIE_CLUSTER_CACHE_URL" not in e for e in _worker_env(render.template(values, crds=True)))
    bucket = url.split("/")[2]
    assert bucket in text.split("--set workers.clusterCache.url")[0], "the guide creates the bucket it sets"
    # the workload identity is on the workers' ServiceAccount alone (they read the bucket)
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"].get("annotations")]
    assert annotation in sa["metadata"]["annotations"]
    others = [d for d in docs if d["kind"] == "ServiceAccount" and d is not sa]
    assert len(others) == 2 and not any(d["metadata"].get("annotations") for d in others)
    # the identity the guide binds is the ServiceAccount the pods run as, in the namespace installed to
    bound = (
        f"[sie/{sa['metadata']['name']}]"
        if "gke" in guide
        else f"--namespace sie --name {sa['metadata']['name']}"
    )
    assert bound in text
    workers = [d for d in docs if d["kind"] == "StatefulSet" and "-w-" in d["metadata"]["name"]]
    assert all(d["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"] for d in workers)
    # the image can read the bucket: the worker image installs the cloud-cache extra
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.worker").read_text()
    assert re.search(r"pip install [^\n]*'\.\[[^\]]*cloud-cache[^\]]*\]'", dockerfile)


def test_wrong_cluster_cache_url_fails(render):
    res = render.template_raw(sets={"workers.clusterCache.url": "http://bucket"})
    assert res.returncode != 0 and "clusterCache" in res.stderr


@pytest.mark.parametrize("release,prefix", [("sie", "sie-"), ("prod", "prod-sie-cluster-")])
def test_helm_install_names_resources_after_the_release(render, release, prefix):
    docs = render.template(release=release)
    names = {d["metadata"]["name"] for d in docs}
    assert names and all(n.startswith(prefix) or n == "sie-server" for n in names), sorted(names)
    assert f"{prefix}gateway" in names


def test_install_notes_warn_about_the_placeholder_registry(render):
    def notes(*sets: str) -> str:
        args = ["install", "sie", str(ROOT / "helm" / "sie-cluster"), "--dry-run=client", "-n", "sie"]
        for s in sets:
            args += ["--set", s]
        res = render.run(*args)
        assert res.returncode == 0, res.stderr
        return res.stdout[res.stdout.index("NOTES:") :]

    assert "WARNING: global.imageRegistry is the placeholder" in notes()
    assert "WARNING" not in notes("global.imageRegistry=registry.example.com/sie")
