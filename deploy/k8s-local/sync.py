#!/usr/bin/env python3
"""Stand-ins for two add-ons a cloud cluster has and this one-node cluster lacks.

Every second, from one ``kubectl get`` of Services, PVCs and PVs:

- cluster DNS: ``<clusterIP> <svc>.<ns>.svc.cluster.local`` lines in a hosts file that
  dnsmasq (``--hostsdir``) serves on the pod bridge; no CoreDNS package exists in Debian;
- a default StorageClass ``local-path``: each pending claim of that class gets a hostPath
  PersistentVolume bound to it, in a world-writable directory under the node's state
  (pods here run as non-root and fsGroup does not apply to hostPath), and a volume whose
  claim is gone is deleted with its directory, as a cloud's ``Delete`` reclaim policy does.

Standard library only: it runs with the host's python3, outside the project's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

CLASS = "local-path"
PROVISIONER = "sie.dev/local-path"

STORAGE_CLASS = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {
        "name": CLASS,
        "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
    },
    "provisioner": PROVISIONER,
    "reclaimPolicy": "Delete",
    "volumeBindingMode": "Immediate",
}


def kubectl(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def write_if_changed(path: str, text: str) -> None:
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    # written beside the watched folder, then moved in: dnsmasq never reads half a file
    tmp = os.path.join(os.path.dirname(os.path.dirname(path)), os.path.basename(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def dns_lines(items: list[dict]) -> str:
    lines = []
    for svc in items:
        ip = svc["spec"].get("clusterIP")
        if not ip or ip == "None":
            continue
        meta = svc["metadata"]
        lines.append(f"{ip} {meta['name']}.{meta['namespace']}.svc.cluster.local\n")
    return "".join(sorted(lines))


def provision(claims: list[dict], volumes: list[dict], voldir: str) -> None:
    bound = {
        (v["spec"]["claimRef"]["namespace"], v["spec"]["claimRef"]["name"])
        for v in volumes
        if v["spec"].get("claimRef")
    }
    for pvc in claims:
        meta, spec = pvc["metadata"], pvc["spec"]
        cls = spec.get("storageClassName")
        if cls != CLASS or spec.get("volumeName") or (meta["namespace"], meta["name"]) in bound:
            continue
        name = f"pvc-{meta['uid']}"
        path = os.path.join(voldir, name)
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o777)
        pv: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name, "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
            "spec": {
                "storageClassName": CLASS,
                "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "claimRef": {
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                },
                "hostPath": {"path": path, "type": "Directory"},
            },
        }
        kubectl("create", "-f", "-", stdin=json.dumps(pv))
        print(f"provisioned {name} for {meta['namespace']}/{meta['name']}", flush=True)
    for pv in volumes:
        meta, spec = pv["metadata"], pv["spec"]
        if meta.get("annotations", {}).get("pv.kubernetes.io/provisioned-by") != PROVISIONER:
            continue
        if pv.get("status", {}).get("phase") in ("Released", "Failed"):
            kubectl("delete", "pv", meta["name"], "--wait=false")
            shutil.rmtree(spec["hostPath"]["path"], ignore_errors=True)
            print(f"deleted {meta['name']} (claim gone)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args()
    hosts = os.path.join(args.state, "dns", "hosts.d", "svc")
    voldir = os.path.join(args.state, "volumes")
    os.makedirs(voldir, exist_ok=True)
    class_made = False
    while True:
        try:
            if not class_made:
                kubectl("apply", "-f", "-", stdin=json.dumps(STORAGE_CLASS))
                class_made = True
            items = json.loads(kubectl("get", "svc,pvc,pv", "-A", "-o", "json"))["items"]
            by_kind: dict[str, list[dict]] = {
                "Service": [],
                "PersistentVolumeClaim": [],
                "PersistentVolume": [],
            }
            for it in items:
                by_kind.setdefault(it["kind"], []).append(it)
            write_if_changed(hosts, dns_lines(by_kind["Service"]))
            provision(by_kind["PersistentVolumeClaim"], by_kind["PersistentVolume"], voldir)
        except Exception as exc:  # the API server may be starting or stopping: try again
            print(f"sync: {exc}", file=sys.stderr, flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
