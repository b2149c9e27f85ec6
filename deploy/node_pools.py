"""The node pools the install guides create (``deploy/docs/node-pools.yaml``): the labels and taints
their nodes carry, and the guides' command blocks, generated so the doc and the chart's test read
the same data. ``python -m deploy.node_pools`` prints the blocks to paste between the guides'
``<!-- node-pools:start -->`` and ``<!-- node-pools:end -->`` markers."""

from __future__ import annotations

from pathlib import Path

from protocol.model_config import load_yaml

DATA = Path(__file__).resolve().parent / "docs" / "node-pools.yaml"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}


def load() -> dict:
    return load_yaml(DATA.read_text())


def node_labels(cloud: str, pool: dict) -> dict[str, str]:
    """The labels the cloud puts on the pool's nodes (GKE and EKS documented well-known labels)."""
    labels = {"node.kubernetes.io/instance-type": pool["machine_type"]}
    if cloud == "gke":
        labels["cloud.google.com/gke-nodepool"] = pool["name"]
        labels["cloud.google.com/machine-family"] = pool["machine_type"].split("-")[0]
        if pool.get("accelerator"):
            labels["cloud.google.com/gke-accelerator"] = pool["accelerator"]
        if pool.get("spot"):
            labels["cloud.google.com/gke-spot"] = "true"
    else:
        labels["eks.amazonaws.com/nodegroup"] = pool["name"]
    return labels


def node_taints(cloud: str, pool: dict) -> list[dict[str, str]]:
    """GKE taints GPU nodes itself; the spot taint and the EKS GPU taint come from the commands."""
    taints = []
    if pool.get("accelerator") or pool.get("gpu"):
        taints.append(GPU_TAINT)
    if pool.get("spot"):
        taints.append(SPOT_TAINT)
    return taints


def _taint_flag(taints: list[dict[str, str]]) -> str:
    return ",".join(f"{t['key']}={t['value']}:{t['effect']}" for t in taints)


def gke_commands(data: dict) -> str:
    c = data["gke"]["cluster"]
    lines: list[str] = []
    for pool in data["gke"]["pools"]:
        scale = f"--enable-autoscaling --min-nodes {pool['min']} --max-nodes {pool['max']}"
        if pool["name"] == "default-pool":
            lines += [
                f"gcloud container clusters create {c['name']} --region {c['region']} "
                f"--workload-pool={c['project']}.svc.id.goog \\",
                f"  --machine-type {pool['machine_type']} --num-nodes {pool['min']} {scale}",
            ]
            continue
        if pool.get("optional"):
            lines.append("# optional: only for the `large` worker pool (workers.pools.large.enabled=true)")
        lines += [
            f"gcloud container node-pools create {pool['name']} --cluster {c['name']} --region {c['region']} \\",
            f"  --machine-type {pool['machine_type']} "
            f"--accelerator type={pool['accelerator']},count=1,gpu-driver-version=latest \\",
        ]
        extra = " --spot --node-taints " + _taint_flag([SPOT_TAINT]) if pool.get("spot") else ""
        lines.append(f"  {scale}{extra}")
    return "\n".join(lines)


def eks_commands(data: dict) -> str:
    c = data["eks"]["cluster"]
    lines: list[str] = []
    for pool in data["eks"]["pools"]:
        size = f"--nodes-min {pool['min']} --nodes-max {pool['max']}"
        if pool["name"] == "system":
            lines += [
                f"eksctl create cluster --name {c['name']} --region {c['region']} --with-oidc "
                f"--nodegroup-name {pool['name']} \\",
                f"  --node-type {pool['machine_type']} --nodes {pool['min']} {size}",
            ]
            continue
        taints = node_taints("eks", pool)
        lines += [
            f"eksctl create nodegroup --cluster {c['name']} --region {c['region']} --name {pool['name']} "
            f"--node-type {pool['machine_type']} \\",
            f"  {size}" + (f" --node-taints {_taint_flag(taints)}" if taints else ""),
        ]
    return "\n".join(lines)


def blocks() -> dict[str, str]:
    """The fenced command block of each guide, by guide file name."""
    data = load()
    return {
        "install-gke.md": f"```bash\n{gke_commands(data)}\n```",
        "install-eks.md": f"```bash\n{eks_commands(data)}\n```",
    }


if __name__ == "__main__":
    for guide, block in blocks().items():
        print(f"{guide}:\n{block}\n")
