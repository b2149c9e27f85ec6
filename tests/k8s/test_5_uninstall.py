"""``helm uninstall`` leaves only what docs/kubernetes.md says it keeps (runs last)."""

from __future__ import annotations

import time

import pytest

from tests.k8s.support import REPO, Cluster

pytestmark = pytest.mark.k8s

# What Kubernetes itself puts in every namespace
NAMESPACE_DEFAULTS = ("serviceaccount/default", "configmap/kube-root-ca.crt", "secret/default-token-")
KEPT = {"persistentvolumeclaim/sie-config-state", "persistentvolumeclaim/data-sie-nats-0"}
KINDS = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,persistentvolumeclaims,poddisruptionbudgets,endpoints"


def leftovers(cluster: Cluster) -> set[str]:
    names = cluster.kubectl("get", KINDS, "-o", "name").split()
    out = set()
    for n in names:
        kind, _, name = n.partition("/")
        short = kind.split(".")[0] + "/" + name
        if any(short.startswith(d) for d in NAMESPACE_DEFAULTS):
            continue
        out.add(short)
    return out


def test_uninstall_leaves_only_what_the_docs_say(cluster: Cluster, table):
    cluster.helm("uninstall", cluster.release, "--wait", "--timeout", "5m")
    deadline = time.monotonic() + 300
    while (left := leftovers(cluster)) - KEPT and time.monotonic() < deadline:
        time.sleep(2)
    assert left == KEPT, sorted(left)
    guide = (REPO / "docs" / "kubernetes.md").read_text()
    assert all(k.split("/")[1] in guide for k in KEPT)
    # cluster-wide: only the two kept claims' volumes
    pvs = cluster.run("kubectl", "get", "pv", "-o", "jsonpath={.items[*].spec.claimRef.name}").split()
    assert sorted(pvs) == sorted(k.split("/")[1] for k in KEPT), pvs
    table.row("helm uninstall", f"left: {', '.join(sorted(left))} (kept on purpose) and their 2 volumes")
