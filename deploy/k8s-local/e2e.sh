#!/bin/bash
# make e2e-k8s: k8s-up, the suite (pytest -m k8s tests/k8s), k8s-down, then the table of checks.
# Exits non-zero when any of the three failed; k8s-down runs whatever happened before it.
set -uo pipefail
HERE=$(dirname "$(readlink -f "$0")")
REPO=$(cd "$HERE/../.." && pwd)
OUT=$REPO/.k8s-e2e
mkdir -p "$OUT"
rm -f "$OUT/table.txt"
# what k8s-down must give back: links, iptables tables and chains, the sysctls the node
# touches, mounts of pod namespaces and node state, processes of the node
host_state() {
  ip -o link | awk -F': ' '{print "link", $2}' | sed 's/@.*//' | sort
  iptables-save | grep -E '^\*|^:' | sed 's/ \[.*//' | sort
  sysctl vm.overcommit_memory kernel.panic kernel.panic_on_oops net.ipv4.conf.all.route_localnet \
    net.ipv4.ip_forward 2>/dev/null
  grep -E '/run/netns|/var/lib/sie-k8s' /proc/self/mountinfo | awk '{print "mount", $5}' | sort
  pgrep -a -f '/var/lib/sie-k8s|/var/cache/sie-k8s/bin' | awk '{print "process", $2}' | sort
}
# the Debian packages first: installing iptables on a fresh host is not something k8s-down undoes,
# and before it there is no iptables-save to read the host with
"$HERE/node.sh" install || exit 1
host_state >"$OUT/host-before.txt"
T0=$SECONDS
"$HERE/up.sh" 2>&1 | tee "$OUT/up.log"
up_rc=${PIPESTATUS[0]}
UP_S=$((SECONDS - T0))
rc=$up_rc
if [ "$up_rc" = 0 ]; then
  SIE_K8S_REQUIRED=1 SIE_K8S_TABLE="$OUT/table.txt" "$REPO/.venv/bin/python" -m pytest -m k8s tests/k8s \
    --timeout 1800 -rA ${PYTEST_ARGS:-}
  rc=$?
fi
SUITE_S=$((SECONDS - T0 - UP_S))
"$HERE/down.sh"
down_rc=$?
host_state >"$OUT/host-after.txt"
if [ "$down_rc" = 0 ] && cmp -s "$OUT/host-before.txt" "$OUT/host-after.txt"; then
  row="pass    links, iptables, sysctls, mounts, processes as before k8s-up"
else
  row="FAIL    rc $down_rc; $(diff "$OUT/host-before.txt" "$OUT/host-after.txt" | grep '^[<>]' | head -5 | tr '\n' ' ')"
  down_rc=1
fi
[ -f "$OUT/table.txt" ] || echo "(no suite table)" >"$OUT/table.txt"
grep -q "rows pass$" "$OUT/table.txt" && sed -i '$d' "$OUT/table.txt"  # the count line, written again below
echo "make k8s-down leaves the host clean  $row" >>"$OUT/table.txt"
echo "$(grep -c '  pass  ' "$OUT/table.txt") of $(($(wc -l <"$OUT/table.txt") - 2)) rows pass" >>"$OUT/table.txt"
[ "$rc" = 0 ] && rc=$down_rc
echo
echo "==== make e2e-k8s: k8s-up $UP_S s (rc $up_rc), suite $SUITE_S s, k8s-down rc $down_rc"
"$HERE/images.sh" report 2>/dev/null || true
[ -f "$OUT/table.txt" ] && cat "$OUT/table.txt"
exit "$rc"
