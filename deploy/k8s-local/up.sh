#!/bin/bash
# make k8s-up: a one-node Kubernetes here, the project's images in its registry, the chart
# installed with deploy/k8s-local/values.yaml, every pod Ready. Idempotent.
# The last two lines printed are the gateway's URL (from this host) and KUBECONFIG=<path>.
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
REPO=$(cd "$HERE/../.." && pwd)
S=${SIE_K8S_STATE:-/var/lib/sie-k8s}
CACHE=${SIE_K8S_CACHE:-/var/cache/sie-k8s}
NS=${SIE_K8S_NAMESPACE:-sie}
RELEASE=${SIE_K8S_RELEASE:-sie}
export KUBECONFIG=$S/kubeconfig
GATEWAY_URL=http://127.0.0.1:30080
PY=$REPO/.venv/bin/python

say() { echo "k8s-up: $*" >&2; }
die() { say "$*"; exit 1; }
step() { say "$1 ($(( SECONDS - T0 )) s)"; }
T0=$SECONDS

[ "$(id -u)" = 0 ] || die "must run as root (containerd, kubelet, iptables); nothing was started"
[ -x "$PY" ] || die "no $PY: run 'make dev' first"
HELM=$("$PY" -c 'from tests.helm.helm_binary import find_helm; h, why = find_helm(); print(h or "")')
[ -n "$HELM" ] || die "no helm binary (tests/helm/helm_binary.py found none)"

step "Debian packages"; "$HERE/node.sh" install
# The images build while the node's binaries compile and the node starts: on a fresh machine
# debootstrap and the wheelhouse download wait on the network, not on the 2 cores Go uses.
mkdir -p "$CACHE/build"
step "images (building beside the node, log: $CACHE/build/images.log)"
"$HERE/images.sh" build >"$CACHE/build/images.log" 2>&1 &
IMAGES_PID=$!
step "Kubernetes binaries"; "$HERE/node.sh" build
step "node"; "$HERE/node.sh" start
wait "$IMAGES_PID" || { tail -30 "$CACHE/build/images.log" >&2; die "image build failed"; }
step "images pushed to the node's registry"; "$HERE/images.sh" push
"$HERE/images.sh" report >&2

step "helm upgrade --install $RELEASE"
"$HELM" upgrade --install "$RELEASE" "$REPO/helm/sie-cluster" -n "$NS" --create-namespace \
  -f "$HERE/values.yaml" --wait --timeout 15m >"$S/helm-install.log" 2>&1 \
  || { cat "$S/helm-install.log" >&2; kubectl get pods -n "$NS" -o wide >&2 || true; die "helm install failed"; }
step "waiting for every pod to be Ready"
kubectl wait -n "$NS" --for=condition=Ready pod -l "app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component!=test" \
  --timeout=600s >/dev/null || { kubectl get pods -n "$NS" -o wide >&2; die "pods not Ready"; }
for _ in $(seq 1 120); do curl -sf "$GATEWAY_URL/readyz" >/dev/null && break; sleep 1; done
curl -sf "$GATEWAY_URL/readyz" >/dev/null || die "gateway not ready at $GATEWAY_URL"
kubectl get pods -n "$NS" -o wide >&2
step "ready"
say "the gateway needs a bearer token: kubectl -n $NS get secret $RELEASE-auth -o jsonpath='{.data.SIE_AUTH_TOKENS}' | base64 -d"
echo "$GATEWAY_URL"
echo "KUBECONFIG=$KUBECONFIG"
