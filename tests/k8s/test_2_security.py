"""An attacker inside the cluster: a pod with no credentials, in the release's namespace, tries what
no one may do without them (docs/security.md). Each try must be refused. The pod runs the gateway's
image, which has Python and nats-py, with labels no NetworkPolicy admits, so on a network plugin that
enforces NetworkPolicy even the connections are dropped; this node's bridge plugin does not enforce
them, so here the refusals come from NATS's users and allow-lists and from the tokens."""

from __future__ import annotations

import json

import pytest

from tests.k8s.support import Cluster

pytestmark = pytest.mark.k8s

ATTACK = r"""
import asyncio, json, socket, urllib.error, urllib.request
import nats

NS, NATS, CONFIG, GATEWAY = {ns!r}, {nats!r}, {config!r}, {gateway!r}
out = {{}}

async def nats_try(name, act):
    errors = []
    async def on_error(exc):
        errors.append(str(exc))
    try:
        nc = await asyncio.wait_for(
            nats.connect(f"nats://{{NATS}}", allow_reconnect=False, connect_timeout=3, error_cb=on_error), 10
        )
    except Exception as exc:
        out[name] = ("refused: " if "Authorization" in str(exc) else "UNREACHABLE: ") + str(exc)[:120]
        return
    try:
        await act(nc)
        await nc.flush()
        await asyncio.sleep(0.5)
    except Exception as exc:
        errors.append(str(exc))
    await nc.close()
    out[name] = ("refused: " + errors[0][:120]) if errors else "ALLOWED"

async def main():
    await nats_try("nats publish to a work subject", lambda nc: nc.publish("sie.work.default.cpu.default.m", b"x"))
    await nats_try("nats subscribe to >", lambda nc: nc.subscribe(">"))
    await nats_try("nats publish a config delta", lambda nc: nc.publish("sie.config.models._all", b"{{}}"))

asyncio.run(main())

# a NATS route: the cluster port of a member (one member here: none listens; with three, a route
# without the route user's password is refused, tests/helm/test_chart_security.py)
try:
    s = socket.create_connection((NATS.split(":")[0], 6222), timeout=3)
    s.sendall(b'CONNECT {{"verbose":false,"pedantic":false,"name":"intruder"}}\r\nPING\r\n')
    s.settimeout(3)
    got = s.recv(4096).decode(errors="replace")
    out["nats route connection"] = "refused: " + got[:120] if "-ERR" in got or not got else "ALLOWED: " + got[:120]
except OSError as exc:
    out["nats route connection"] = "refused: " + str(exc)[:120]

def http(name, method, url, body=None):
    req = urllib.request.Request(url, method=method, data=body, headers={{"content-type": "application/json"}})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            out[name] = f"ALLOWED: {{r.status}}"
    except urllib.error.HTTPError as e:
        out[name] = f"refused: {{e.code}}" if e.code in (401, 403) else f"ALLOWED?: {{e.code}}"
    except OSError as exc:
        out[name] = "UNREACHABLE: " + str(exc)[:120]

http("config service export (reads)", "GET", f"http://{{CONFIG}}/v1/configs/export")
http("config service model write", "POST", f"http://{{CONFIG}}/v1/configs/models", b"sie_id: evil/model\n")
http("gateway encode", "POST", f"http://{{GATEWAY}}/v1/encode/sentence-transformers/all-MiniLM-L6-v2", b'{{"items": [{{"text": "x"}}]}}')
http("gateway pool create (admin)", "POST", f"http://{{GATEWAY}}/v1/pools", json.dumps({{"name": "evil", "gpus": {{"cpu": 1}}}}).encode())
http("gateway pool delete (admin)", "DELETE", f"http://{{GATEWAY}}/v1/pools/default")
print("RESULT " + json.dumps(out))
"""


def test_a_pod_without_credentials_is_refused_everywhere(cluster: Cluster, table):
    ns, rel = cluster.namespace, cluster.release
    gateway = cluster.get("deployment", f"{rel}-gateway")
    image = gateway["spec"]["template"]["spec"]["containers"][0]["image"]
    script = ATTACK.format(
        ns=ns,
        nats=f"{rel}-nats.{ns}.svc:4222",
        config=f"{rel}-config.{ns}.svc:8090",
        gateway=f"{rel}-gateway.{ns}.svc:8080",
    )
    overrides = {
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
        }
    }
    cluster.kubectl("delete", "pod", "attacker", "--ignore-not-found", "--wait=true", timeout=120)
    try:
        cluster.kubectl(
            "run", "attacker", "--image", image, "--restart=Never", "--labels=app=attacker",
            "--image-pull-policy=IfNotPresent", f"--overrides={json.dumps(overrides)}",
            "--command", "--", "python", "-c", script,
        )  # fmt: skip
        cluster.kubectl(
            "wait", "pod/attacker", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=300s", timeout=330
        )
        logs = cluster.kubectl("logs", "attacker")
    finally:
        cluster.kubectl("delete", "pod", "attacker", "--ignore-not-found", "--wait=false", check=False)
    line = next(line for line in logs.splitlines() if line.startswith("RESULT "))
    results: dict[str, str] = json.loads(line[len("RESULT ") :])
    for check, outcome in sorted(results.items()):
        table.row(f"no credentials: {check}", outcome[:100])
    assert len(results) == 9, results
    # refused by the service itself (NATS's authorization, a 401/403), not merely unreachable
    allowed = {k: v for k, v in results.items() if not v.startswith("refused")}
    assert not allowed, allowed
    for check, outcome in results.items():
        if check.startswith("nats") and check != "nats route connection":
            assert "Authorization Violation" in outcome, (check, outcome)
        elif not check.startswith("nats"):
            assert outcome in ("refused: 401", "refused: 403"), (check, outcome)
    # the policies are in the cluster (this node's bridge plugin does not enforce them)
    policies = {p["metadata"]["name"] for p in cluster.get("networkpolicy")["items"]}
    assert {f"{rel}-nats", f"{rel}-config", f"{rel}-workers", f"{rel}-gateway"} <= policies
    table.row(
        "NetworkPolicies installed", ", ".join(sorted(policies)) + " (not enforced by the bridge plugin)"
    )
