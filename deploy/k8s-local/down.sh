#!/bin/bash
# make k8s-down: stop the node that k8s-up started and remove what it changed on the host
# (processes by pid, pod network namespaces, the bridge, KUBE-/CNI- iptables chains, mounts;
# sysctls put back). Idempotent. The caches in /var/cache/sie-k8s stay (rm -rf it to reclaim).
set -euo pipefail
exec "$(dirname "$(readlink -f "$0")")/node.sh" stop
