#!/bin/bash
# A one-node Kubernetes v1.20.2 on this machine, for the chart's end-to-end tests.
# Recipe and measurements: shared/spec/k8s-local.md. Needs root.
#
#   node.sh check     what is missing (root, Debian packages, cached binaries)
#   node.sh install   apt-get install the Debian packages it needs
#   node.sh build     build the k8s binaries from Debian's source package (cached)
#   node.sh start     start etcd .. kube-proxy, a registry and a DNS stand-in (idempotent)
#   node.sh stop      stop all of it, remove bridges/iptables chains, restore sysctls (idempotent)
#   node.sh status    print what runs
#
# Slow things live in $SIE_K8S_CACHE (default /var/cache/sie-k8s), kept between runs;
# a running node's state lives in $SIE_K8S_STATE (default /var/lib/sie-k8s), removed by stop.
set -euo pipefail

K8S_VERSION=v1.20.2
CACHE=${SIE_K8S_CACHE:-/var/cache/sie-k8s}
S=${SIE_K8S_STATE:-/var/lib/sie-k8s}
BIN=$CACHE/bin/$K8S_VERSION
BRIDGE=klocal0
BRIDGE_IP=10.244.0.1
POD_CIDR=10.244.0.0/24
SVC_CIDR=10.96.0.0/16
API_PORT=16443
REGISTRY=127.0.0.1:15000
TOKEN_FILE=$S/pki/tokens.csv
COMPONENTS="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"
SYSCTLS="vm.overcommit_memory kernel.panic kernel.panic_on_oops net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables net.ipv4.ip_forward"
DEBS="golang-go rsync etcd-server etcd-client containerd runc containernetworking-plugins iptables
conntrack gcc libc6-dev dpkg-dev openssl curl dnsmasq-base docker-registry podman buildah
debootstrap fuse-overlayfs uidmap skopeo iproute2 xz-utils nftables"
export KUBECONFIG=$S/kubeconfig

say() { echo "k8s-local: $*" >&2; }
die() { say "$*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it starts containerd, a kubelet and iptables rules); run: sudo make k8s-up"; }

missing_debs() {
  local p out=""
  for p in $DEBS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || out="$out $p"; done
  echo "${out# }"
}

check() {
  need_root
  local m; m=$(missing_debs)
  [ -z "$m" ] || die "Debian packages missing: $m (run: $0 install)"
  command -v kubectl >/dev/null || die "kubectl missing (any client >= 1.20 works)"
  local c; for c in $COMPONENTS pause; do [ -x "$BIN/$c" ] || die "binary missing: $BIN/$c (run: $0 build, ~10 min on 2 cores)"; done
}

install() {
  need_root
  local m; m=$(missing_debs)
  if [ -n "$m" ]; then
    say "apt-get install $m"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $m >/dev/null
  fi
  # the build needs Debian's source for kubernetes: add deb-src lines once
  if ! grep -rqs '^Types: deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
    say "adding deb-src entries (Debian's kubernetes source package)"
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > /etc/apt/sources.list.d/debian-src.sources
    apt-get update -qq
  fi
}

build() {
  need_root
  mkdir -p "$CACHE/src" "$BIN"
  local c todo=""
  for c in $COMPONENTS; do [ -x "$BIN/$c" ] || todo="$todo $c"; done
  if [ -n "$todo" ]; then
    cd "$CACHE/src"
    if [ ! -d k8s ]; then
      say "fetching Debian's kubernetes source package"
      ls kubernetes_*.dsc >/dev/null 2>&1 || apt-get source -qq --download-only kubernetes/bookworm 2>/dev/null \
        || die "apt-get source kubernetes/bookworm failed: are deb-src entries present? (run: $0 install)"
      rm -rf k8s.tmp && dpkg-source -x --no-check kubernetes_*.dsc k8s.tmp >/dev/null && mv k8s.tmp k8s
    fi
    cd k8s
    mkdir -p .go/src/k8s.io
    [ -L .go/src/k8s.io/kubernetes ] || ln -s ../../.. .go/src/k8s.io/kubernetes
    for c in $todo; do
      say "building $c $K8S_VERSION (cold: ~10 min for all five on 2 cores)"
      GOPATH=$PWD/.go CGO_ENABLED=0 GOCACHE=$CACHE/gocache HOME=$CACHE GOFLAGS= \
        make WHAT=cmd/$c >"$CACHE/build-$c.log" 2>&1 || die "build of $c failed: $CACHE/build-$c.log"
      strip -o "$BIN/$c.tmp" _output/bin/$c 2>/dev/null || cp _output/bin/$c "$BIN/$c.tmp"
      mv "$BIN/$c.tmp" "$BIN/$c"
    done
  fi
  if [ ! -x "$BIN/pause" ]; then
    [ -f "$CACHE/src/k8s/build/pause/linux/pause.c" ] || die "pause.c missing: remove $CACHE/src/k8s and rerun build"
    gcc -Os -static -o "$BIN/pause.tmp" "$CACHE/src/k8s/build/pause/linux/pause.c" && mv "$BIN/pause.tmp" "$BIN/pause"
  fi
  # the source tree and Go's cache (about 9 GB) are only needed for another build
  rm -rf "$CACHE/src/k8s" "$CACHE/src/k8s.tmp" "$CACHE/gocache"
  say "binaries ready in $BIN"
}


wait_for() {  # wait_for "<shell condition>" <seconds>
  local i end=$((SECONDS + ${2:-60}))
  while [ $SECONDS -lt $end ]; do eval "$1" >/dev/null 2>&1 && return 0; sleep 0.5; done
  say "timed out after ${2:-60}s waiting for: $1"; return 1
}

running() { [ -f "$S/pids/$1" ] && kill -0 "$(cat "$S/pids/$1")" 2>/dev/null; }

launch() {  # launch NAME CMD...: a daemon whose pid lands in $S/pids/NAME, log in $S/logs/NAME.log
  local n=$1; shift
  running "$n" && return 0
  setsid nohup "$@" >"$S/logs/$n.log" 2>&1 </dev/null &
  echo $! >"$S/pids/$n"
}

ctr_() { ctr -a "$S/ctrd/containerd.sock" -n k8s.io "$@"; }

pki() {
  [ -f "$S/pki/sa.key" ] && return 0
  mkdir -p "$S/pki"
  openssl genrsa -out "$S/pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$S/pki/sa.key" -pubout -out "$S/pki/sa.pub" 2>/dev/null
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$S/pki/ca.key" -out "$S/pki/ca.crt" -days 30 \
    -subj /CN=sie-k8s-local-ca 2>/dev/null
  local token; token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
  echo "$token,admin,admin,system:masters" >"$TOKEN_FILE"
  chmod 600 "$TOKEN_FILE" "$S/pki/sa.key" "$S/pki/ca.key"
  cat >"$KUBECONFIG" <<KC
apiVersion: v1
kind: Config
clusters:
- name: sie-local
  cluster: {server: "https://127.0.0.1:$API_PORT", insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: "$token"}
contexts:
- name: sie-local
  context: {cluster: sie-local, user: admin}
current-context: sie-local
KC
  chmod 600 "$KUBECONFIG"
}

write_configs() {
  mkdir -p "$S/ctrd" "$S/cni/net.d" "$S/kubelet" "$S/dns/hosts.d" "$CACHE/registry" "$S/volumes"
  cat >"$S/ctrd/config.toml" <<CFG
version = 2
root = "$S/ctrd/root"
state = "$S/ctrd/state"
[grpc]
  address = "$S/ctrd/containerd.sock"
[ttrpc]
  address = "$S/ctrd/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "k8s.gcr.io/pause:3.2"
  # this machine lacks CAP_SYS_RESOURCE: runc cannot set a negative oom_score_adj
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$S/cni/net.d"
  # no public registry is reachable: the local registry serves what the chart names
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]
    endpoint = ["http://$REGISTRY"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."ghcr.io"]
    endpoint = ["http://$REGISTRY"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."$REGISTRY"]
    endpoint = ["http://$REGISTRY"]
CFG
  cat >"$S/cni/net.d/10-bridge.conflist" <<CNI
{"cniVersion": "0.4.0", "name": "sie-local", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$S/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}},
  {"type": "loopback"}]}
CNI
  printf 'version: 0.1\nstorage: {filesystem: {rootdirectory: %s}, delete: {enabled: true}}\nhttp: {addr: "%s"}\nlog: {level: warn}\n' \
    "$CACHE/registry" "$REGISTRY" >"$S/registry.yml"
  cat >"$S/kubelet/config.yaml" <<KL
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
# QoS cgroups leave pod cgroups behind in the cgroup2 'unified' tree of this hybrid host,
# and the kubelet then never finishes deleting a pod
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
clusterDNS: ["$BRIDGE_IP"]
clusterDomain: cluster.local
evictionHard: {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
KL
  cat >"$S/kubelet/proxy.yaml" <<KP
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $KUBECONFIG}
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $(hostname)
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["127.0.0.0/8"]
conntrack: {maxPerCore: 0}
KP
}

pause_image() {
  ctr_ images ls -q 2>/dev/null | grep -qx 'k8s.gcr.io/pause:3.2' && return 0
  local d=$S/pause
  mkdir -p "$d" && cp "$BIN/pause" "$d/pause"
  python3 - "$d" <<'PY'
# a one-layer docker-archive holding the static pause binary: no image tool needed
import hashlib, io, json, os, sys, tarfile
d = sys.argv[1]
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as t:
    t.add(os.path.join(d, "pause"), arcname="pause")
layer = buf.getvalue()
cfg = json.dumps({"architecture": "amd64", "os": "linux",
                  "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
                  "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}}).encode()
cid = hashlib.sha256(cfg).hexdigest()
man = json.dumps([{"Config": cid + ".json", "RepoTags": ["k8s.gcr.io/pause:3.2"], "Layers": ["layer.tar"]}]).encode()
with tarfile.open(os.path.join(d, "pause.tar"), "w") as t:
    for name, data in ((cid + ".json", cfg), ("layer.tar", layer), ("manifest.json", man)):
        ti = tarfile.TarInfo(name); ti.size = len(data); t.addfile(ti, io.BytesIO(data))
PY
  ctr_ images import "$d/pause.tar" >/dev/null
}

start() {
  check
  if [ -f "$S/ready" ] && running apiserver && running kubelet && kubectl get --raw /readyz >/dev/null 2>&1; then
    say "already running (KUBECONFIG=$KUBECONFIG)"; return 0
  fi
  local t0=$SECONDS
  mkdir -p "$S/logs" "$S/pids" "$S/etcd"
  pki
  write_configs
  # the saved values come from before this node's first start, never from a half-started one
  [ -f "$S/sysctl.saved" ] || for k in $SYSCTLS; do
    v=$(sysctl -n "$k" 2>/dev/null) && echo "$k=$v"; done >"$S/sysctl.saved"
  # iptables tables that exist now (kube-proxy and CNI add nat/filter/mangle), and /run/netns
  [ -f "$S/iptables-tables.saved" ] || iptables-save | sed -n 's/^\*//p' >"$S/iptables-tables.saved"
  [ -e /run/netns ] || { mkdir -p /run/netns; touch "$S/netns-made"; }
  # pod bridge up front: dnsmasq listens on it and the API server advertises its address to pods
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr show dev "$BRIDGE" | grep -q "$BRIDGE_IP/" || ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  launch etcd etcd --name sie-local --data-dir "$S/etcd" \
    --listen-client-urls http://127.0.0.1:12379 --advertise-client-urls http://127.0.0.1:12379 \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster sie-local=http://127.0.0.1:12380 --listen-metrics-urls http://127.0.0.1:12381
  wait_for "curl -sf http://127.0.0.1:12379/health" 30
  launch apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:12379 --bind-address=0.0.0.0 \
    --secure-port=$API_PORT --advertise-address=$BRIDGE_IP --cert-dir="$S/pki/serving" \
    --token-auth-file="$TOKEN_FILE" --authorization-mode=Node,RBAC \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$S/pki/sa.pub" --service-account-signing-key-file="$S/pki/sa.key" \
    --service-cluster-ip-range=$SVC_CIDR --service-node-port-range=30000-32767 --allow-privileged=true \
    --kubelet-preferred-address-types=Hostname --profiling=false
  wait_for "kubectl get --raw /readyz" 240
  launch kcm "$BIN/kube-controller-manager" --kubeconfig="$KUBECONFIG" --bind-address=127.0.0.1 --port=0 \
    --leader-elect=false --service-account-private-key-file="$S/pki/sa.key" \
    --root-ca-file="$S/pki/serving/apiserver.crt" --use-service-account-credentials=true \
    --cluster-signing-cert-file="$S/pki/ca.crt" --cluster-signing-key-file="$S/pki/ca.key" \
    --controllers='*,-cloud-node-lifecycle' --profiling=false
  launch scheduler "$BIN/kube-scheduler" --kubeconfig="$KUBECONFIG" --bind-address=127.0.0.1 --port=0 \
    --leader-elect=false --profiling=false
  launch registry docker-registry serve "$S/registry.yml"
  launch dnsmasq dnsmasq --keep-in-foreground --no-resolv --no-hosts --listen-address=$BRIDGE_IP \
    --bind-interfaces --local=/cluster.local/ --hostsdir="$S/dns/hosts.d" --pid-file="$S/dns/dnsmasq.pid"
  launch sync python3 "$(dirname "$(readlink -f "$0")")/sync.py" --state "$S"
  # Pod network namespaces are bind mounts in /run/netns. Unless that folder is already a shared
  # mount of itself, the first podman or `ip netns` run binds it over itself, stacking a second copy
  # of every pod's mount; containerd then cannot remove them and those pods stay Terminating.
  mkdir -p /run/netns
  if ! mountpoint -q /run/netns; then
    mount --bind /run/netns /run/netns && mount --make-shared /run/netns && touch "$S/netns-bound"
  fi
  launch containerd containerd --config "$S/ctrd/config.toml"
  wait_for "ctr_ version" 60
  pause_image
  launch kubelet "$BIN/kubelet" --config="$S/kubelet/config.yaml" --kubeconfig="$KUBECONFIG" \
    --container-runtime=remote --container-runtime-endpoint="unix://$S/ctrd/containerd.sock" \
    --root-dir="$S/kubelet/root" --cert-dir="$S/kubelet/pki" --hostname-override="$(hostname)" \
    --node-ip=$BRIDGE_IP
  launch proxy "$BIN/kube-proxy" --config="$S/kubelet/proxy.yaml"
  wait_for "kubectl wait --for=condition=Ready node/$(hostname) --timeout=2s" 240
  wait_for "kubectl get sa default -n default" 60
  wait_for "curl -sf http://$REGISTRY/v2/" 30
  # the kubelet sets kernel.panic=10 and panic_on_oops=1 once at start; give the host its own back
  local kv; while read -r kv; do case $kv in kernel.panic*) sysctl -q -w "$kv" ;; esac; done <"$S/sysctl.saved"
  touch "$S/ready"
  say "node Ready in $((SECONDS - t0)) s (KUBECONFIG=$KUBECONFIG)"
}

stop() {
  [ -d "$S" ] || { say "nothing to stop ($S absent)"; return 0; }
  need_root
  set +e +o pipefail
  k() { local f=$S/pids/$1; [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; }
  kk() { local f=$S/pids/$1 i; [ -f "$f" ] || return 0; for i in $(seq 1 40); do kill -0 "$(cat "$f")" 2>/dev/null || break; sleep 0.25; done
         kill -9 "$(cat "$f")" 2>/dev/null; rm -f "$f"; }
  k kcm; k scheduler; k sync; kk kcm; kk scheduler; kk sync
  k kubelet; k proxy; kk kubelet; kk proxy
  if running containerd; then
    local id
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$id" 2>/dev/null; done
    sleep 1
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$id" 2>/dev/null; done
    # network namespaces of the pod sandboxes: run the CNI teardown by removing the sandboxes
    if command -v crictl >/dev/null; then :; fi
  fi
  k containerd; kk containerd
  # shims outlive containerd: end those of this state dir, by pid
  local p
  for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $S/ctrd/containerd.sock" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  k apiserver; k dnsmasq; k registry; kk apiserver; kk dnsmasq; kk registry
  k etcd; kk etcd
  # iptables chains kube-proxy and the CNI plugins made (KUBE-*, CNI-*)
  local t ch
  for t in nat filter mangle; do
    iptables-save -t $t 2>/dev/null | grep -E '^-A .*(KUBE-|CNI-)' | sed 's/^-A/-D/' | \
      while read -r r; do eval iptables -w -t $t "$r" 2>/dev/null; done
    for ch in $(iptables-save -t $t 2>/dev/null | grep -oE '^:(KUBE|CNI)-[A-Za-z0-9_-]+' | tr -d :); do iptables -w -t $t -F "$ch" 2>/dev/null; done
    for ch in $(iptables-save -t $t 2>/dev/null | grep -oE '^:(KUBE|CNI)-[A-Za-z0-9_-]+' | tr -d :); do iptables -w -t $t -X "$ch" 2>/dev/null; done
  done
  # network namespaces CNI made for pods (named cni-*), mounts under the state dir, the bridge, veths
  clean_netns
  if ls /run/netns/cni-* >/dev/null 2>&1 && mountpoint -q /run/netns && [ ! -f "$S/netns-bound" ]; then
    # stacked under a later bind of /run/netns over itself (see start): lift that bind, retry
    umount -l /run/netns 2>/dev/null; clean_netns
  fi
  [ -f "$S/netns-bound" ] && umount -l /run/netns 2>/dev/null
  grep " $S" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
  grep " /run/netns/cni-" /proc/mounts | awk '{print $2}' | xargs -r -n1 umount -l 2>/dev/null
  ip link del "$BRIDGE" 2>/dev/null
  [ -f "$S/netns-made" ] && rmdir /run/netns 2>/dev/null
  # tables this node brought into being, now empty
  if [ -f "$S/iptables-tables.saved" ]; then
    for t in mangle filter nat; do
      grep -qx "$t" "$S/iptables-tables.saved" && continue
      [ "$(iptables-save -t $t 2>/dev/null | grep -c '^-A')" = 0 ] && nft delete table ip $t 2>/dev/null
    done
  fi
  conntrack -D -s 10.244.0.0/16 >/dev/null 2>&1; conntrack -D -d 10.96.0.0/16 >/dev/null 2>&1
  if [ -f "$S/sysctl.saved" ]; then
    local kv; while read -r kv; do [ -n "$kv" ] && sysctl -q -w "$kv" 2>/dev/null; done <"$S/sysctl.saved"
  fi
  rm -rf "$S"
  say "stopped; removed $S"
}

clean_netns() {  # the pod network namespaces containerd made (cni-*): unmount every copy, remove
  local ns i
  for ns in /run/netns/cni-*; do
    [ -e "$ns" ] || continue
    for i in 1 2 3 4; do mountpoint -q "$ns" || break; umount "$ns" 2>/dev/null || umount -l "$ns" 2>/dev/null; done
    rm -f "$ns" 2>/dev/null
  done
}

status() {
  [ -d "$S/pids" ] || { echo "not running"; return 0; }
  local f
  for f in "$S"/pids/*; do n=$(basename "$f"); if running "$n"; then echo "$n $(cat "$f") running"; else echo "$n $(cat "$f") gone"; fi; done
}

[ $# -ge 1 ] || { sed -n '2,13p' "$0"; exit 2; }
"$@"
