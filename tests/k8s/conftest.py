"""Fixtures and the results table of the suite that runs against ``make k8s-up``'s cluster.

Each check adds one or more rows (``table.row(check, detail)``); the outcome column comes from
the test's own outcome. The table is printed at the end of the run and written to
``$SIE_K8S_TABLE`` (``make e2e-k8s`` prints it again after ``make k8s-down``).
Without a running cluster the suite skips, unless ``SIE_K8S_REQUIRED=1`` (``make e2e-k8s``)
turns that into a failure.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.k8s.support import STATE, Cluster

ROWS: list[dict] = []


class Table:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def row(self, check: str, detail: str) -> None:
        ROWS.append({"nodeid": self.nodeid, "check": check, "detail": detail, "result": "..."})


@pytest.fixture
def table(request) -> Table:
    return Table(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if "k8s" not in item.keywords or rep.when not in ("setup", "call"):
        return
    if rep.when == "setup" and rep.passed:
        return
    mine = [r for r in ROWS if r["nodeid"] == item.nodeid]
    result = "pass" if rep.passed else ("skip" if rep.skipped else "FAIL")
    if not mine:
        name = item.nodeid.split("::", 1)[-1]
        why = ""
        if rep.failed or rep.skipped:
            text = (
                str(rep.longrepr.reprcrash.message)
                if hasattr(rep.longrepr, "reprcrash")
                else str(rep.longrepr)
            )
            why = text.strip().splitlines()[0][:160] if text.strip() else ""
        ROWS.append({"nodeid": item.nodeid, "check": name, "detail": why, "result": result})
        return
    for r in mine:
        r["result"] = result
    if rep.failed and hasattr(rep.longrepr, "reprcrash"):
        mine[-1]["detail"] += " | " + str(rep.longrepr.reprcrash.message).strip().splitlines()[0][:160]


def render_table() -> str:
    if not ROWS:
        return ""
    w = max(len(r["check"]) for r in ROWS)
    lines = [f"{'check'.ljust(w)}  result  detail", f"{'-' * w}  ------  ------"]
    lines += [f"{r['check'].ljust(w)}  {r['result'].ljust(6)}  {r['detail']}" for r in ROWS]
    passed = sum(r["result"] == "pass" for r in ROWS)
    lines.append(f"{passed} of {len(ROWS)} rows pass")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter):
    text = render_table()
    if not text:
        return
    terminalreporter.write_sep("=", "k8s e2e table")
    terminalreporter.write(text)
    target = os.environ.get("SIE_K8S_TABLE")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(text)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    kubeconfig = STATE / "kubeconfig"
    why = None
    if not kubeconfig.exists():
        why = f"no cluster: {kubeconfig} absent (run: make k8s-up)"
    else:
        ok = subprocess.run(
            ["kubectl", "get", "--raw", "/readyz"],
            capture_output=True,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )
        if ok.returncode != 0:
            why = f"no cluster answers at {kubeconfig}: {ok.stderr.decode()[-200:]}"
    from tests.helm.helm_binary import find_helm

    helm, helm_why = find_helm()
    why = why or (None if helm else f"no helm: {helm_why}")
    if why:
        if os.environ.get("SIE_K8S_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)
    assert helm is not None
    cluster = Cluster(kubeconfig=kubeconfig, helm_bin=helm)
    # the gateway runs with token auth (deploy/k8s-local/values.yaml): both SDKs, here and in the
    # scripts the suite runs, send SIE_API_KEY to SIE_BASE_URL's origin (and to no other: the public
    # sie-sdk scopes the key to it); plain HTTP calls take cluster.headers()
    os.environ["SIE_BASE_URL"] = cluster.gateway_url
    os.environ["SIE_API_KEY"] = cluster.api_key()
    return cluster


@pytest.fixture(scope="session")
def sdk() -> None:
    from tests.support.sdk312 import sdk_unavailable

    why = sdk_unavailable()
    if why:
        if os.environ.get("SIE_K8S_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)
