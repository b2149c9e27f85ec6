#!/bin/bash
# make e2e-k8s: k8s-up, the suite (pytest -m k8s tests/k8s), k8s-down, then the table of checks.
# Exits non-zero when any of the three failed; k8s-down runs whatever happened before it.
set -uo pipefail
HERE=$(dirname "$(readlink -f "$0")")
REPO=$(cd "$HERE/../.." && pwd)
OUT=$REPO/.k8s-e2e
mkdir -p "$OUT"
rm -f "$OUT/table.txt"
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
[ "$rc" = 0 ] && rc=$down_rc
echo
echo "==== make e2e-k8s: k8s-up $UP_S s (rc $up_rc), suite $SUITE_S s, k8s-down rc $down_rc"
"$HERE/images.sh" report 2>/dev/null || true
[ -f "$OUT/table.txt" ] && cat "$OUT/table.txt"
exit "$rc"
