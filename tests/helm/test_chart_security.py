"""The chart's security defaults (docs/security.md), rendered and, for NATS, run: auth before
exposure, NATS users with allow-lists, authenticated routes, TLS, the monitor port off the client
Service, NetworkPolicies, one ServiceAccount per component, a pool-admin token for the gateway."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from protocol import nats_permissions
from tests.helm.conftest import CHART
from tests.helm.test_chart import by_kind, check_nats_conf, env_of, local_nats_conf, pod_spec

THREE = {"nats.replicas": "3", "queue.streamReplicas": "3"}


def nats_secret(docs: list[dict]) -> dict[str, str]:
    (sec,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-nats-auth")]
    return sec["stringData"]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


# ---------------------------------------------------------------------- auth before exposure
@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_an_exposed_gateway_without_auth_fails_naming_the_values(render, service_type):
    res = render.template_raw(sets={"gateway.service.type": service_type})
    assert res.returncode != 0
    assert f"gateway.service.type={service_type}" in res.stderr
    assert "auth.mode=token" in res.stderr and "auth.allowAnonymous=true" in res.stderr


def test_an_exposed_gateway_renders_with_auth_or_an_explicit_anonymous(render):
    for sets in (
        {"gateway.service.type": "LoadBalancer", "auth.mode": "token"},
        {"gateway.service.type": "LoadBalancer", "auth.allowAnonymous": "true"},
        {"gateway.service.type": "ClusterIP"},
    ):
        render.template(sets=sets)


def test_auth_on_without_tokens_generates_one_and_the_notes_say_how_to_read_it(render):
    docs = render.template(sets={"auth.mode": "token"})
    sec = named(docs, "Secret", "sie-auth")["stringData"]
    assert len(sec["SIE_AUTH_TOKENS"]) >= 32
    res = render.run(
        "install", "sie", str(CHART), "--dry-run=client", "-n", "sie", "--set", "auth.mode=token"
    )
    assert res.returncode == 0, res.stderr
    notes = res.stdout[res.stdout.index("NOTES:") :]
    assert "jsonpath='{.data.SIE_AUTH_TOKENS}'" in notes
    # given tokens are used as they are
    docs = render.template(sets={"auth.mode": "token", "auth.inferenceTokens[0]": "t" * 20})
    assert named(docs, "Secret", "sie-auth")["stringData"]["SIE_AUTH_TOKENS"] == "t" * 20


def test_the_gateway_holds_a_pool_admin_token_not_the_config_services_admin_token(render):
    docs = render.template()
    sec = named(docs, "Secret", "sie-auth")["stringData"]
    assert sec["SIE_POOL_ADMIN_TOKEN"] and sec["SIE_POOL_ADMIN_TOKEN"] != sec["SIE_ADMIN_TOKEN"]
    gateway = pod_spec(named(docs, "Deployment", "sie-gateway"))["containers"][0]
    refs = {
        name: (e.get("valueFrom") or {}).get("secretKeyRef", {}).get("key")
        for name, e in env_of(gateway).items()
    }
    assert refs["SIE_ADMIN_TOKEN"] == "SIE_POOL_ADMIN_TOKEN"
    assert "SIE_ADMIN_TOKEN" not in refs.values()
    config = pod_spec(named(docs, "Deployment", "sie-config"))["containers"][0]
    assert env_of(config)["SIE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "SIE_ADMIN_TOKEN"


# ---------------------------------------------------------------------- ServiceAccounts
def test_one_service_account_per_component_and_only_the_workers_get_an_identity(render):
    docs = render.template(
        "values-gke.yaml", sets={"serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account": "w@p.iam"}
    )
    accounts = {d["metadata"]["name"]: d for d in by_kind(docs, "ServiceAccount")}
    assert set(accounts) == {"sie-server", "sie-gateway", "sie-config"}
    assert accounts["sie-server"]["metadata"]["annotations"]
    assert not accounts["sie-gateway"]["metadata"].get("annotations")
    assert not accounts["sie-config"]["metadata"].get("annotations")
    runs_as = {
        d["metadata"]["name"]: pod_spec(d)["serviceAccountName"]
        for d in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
        if d["metadata"]["name"] != "sie-nats"
    }
    assert runs_as.pop("sie-gateway") == "sie-gateway"
    assert runs_as.pop("sie-config") == "sie-config"
    assert runs_as and set(runs_as.values()) == {"sie-server"}  # the worker StatefulSets


# ---------------------------------------------------------------------- NATS
def test_the_charts_nats_permissions_are_the_protocols(render):
    """files/nats-permissions.json is `python -m protocol.nats_permissions`, and the rendered
    users carry exactly those lists: `sie up` runs what the chart deploys."""
    on_disk = (CHART / "files" / "nats-permissions.json").read_text()
    assert on_disk == nats_permissions.to_json(), "regenerate: python -m protocol.nats_permissions"
    conf = nats_secret(render.template())["auth.conf"]
    for role, perms in nats_permissions.permissions().items():
        block = conf[conf.index(f"{{user: {role},") :]
        assert "publish" in perms and "subscribe" in perms
        for direction in ("publish", "subscribe"):
            for kind, subjects in perms[direction].items():
                rendered = re.search(rf"{direction}: \{{[^}}]*?{kind}: \[([^\]]*)\]", block, re.S)
                assert rendered, (role, direction, kind)
                assert json.loads(f"[{rendered.group(1)}]") == subjects, (role, direction, kind)


def test_every_nats_user_has_allow_lists_for_publish_and_subscribe():
    perms = nats_permissions.permissions()
    assert set(perms) == {"gateway", "sidecar", "config"}
    for role, p in perms.items():
        assert p["publish"].get("allow"), role  # publish: only what is listed
        sub = p["subscribe"]
        assert sub.get("allow") or sub.get("deny") == [">"], role  # subscribe: listed, or nothing
    # only the config service may publish config deltas
    for role in ("gateway", "sidecar"):
        assert not any(s.startswith("sie.config") for s in perms[role]["publish"]["allow"])
    assert perms["config"]["publish"]["allow"] == ["sie.config.models.>"]
    # a sidecar never subscribes to the gateways' inboxes, nor publishes work
    assert not any(s.startswith(("_INBOX.", ">")) for s in perms["sidecar"]["subscribe"]["allow"])
    assert not any(
        s.startswith(("sie.work", "sie.direct", "sie.pin", "$KV"))
        for s in perms["sidecar"]["publish"]["allow"]
    )


def test_the_monitor_port_is_not_on_the_client_service(render):
    docs = render.template()
    ports = {p["name"] for p in named(docs, "Service", "sie-nats")["spec"]["ports"]}
    assert ports == {"client"}
    monitor = named(docs, "Service", "sie-nats-monitor")["spec"]["ports"]
    assert [p["port"] for p in monitor] == [8222]


def test_keda_reads_the_monitor_service(render):
    docs = render.template(crds=True, sets={"autoscaling.mode": "keda"})
    text = json.dumps(by_kind(docs, "ScaledObject"))
    assert "sie-nats-monitor.sie.svc:8222" in text


def _write_conf(docs: list[dict], tmp_path: Path, port: int, mon: int, certs: Path | None = None) -> Path:
    sec = nats_secret(docs)
    conf = local_nats_conf(docs, tmp_path)
    if certs is not None:
        conf = conf.replace("/etc/nats/tls", str(certs))
    conf = re.sub(r"(?m)^port: \d+", f"port: {port}\nhost: 127.0.0.1", conf)
    conf = re.sub(r"(?m)^http_port: \d+", f"http_port: {mon}", conf)
    (tmp_path / "auth").mkdir(exist_ok=True)
    for key in ("auth.conf", "cluster.conf"):
        if key in sec:
            (tmp_path / "auth" / key).write_text(sec[key])
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    check_nats_conf(path)
    return path


def _start(path: Path, *extra: str) -> subprocess.Popen:
    from tests.support.nats_server import nats_server_binary

    return subprocess.Popen(
        [nats_server_binary(), "-c", str(path), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)


def _url(docs: list[dict], role: str, port: int) -> str:
    url = nats_secret(docs)[f"{role}-url"]
    return re.sub(r"@.+$", f"@127.0.0.1:{port}", url)


def test_rendered_nats_refuses_what_no_role_may_do(render, tmp_path):
    """Against the rendered config on a real nats-server: no credentials, a wrong password, a
    sidecar publishing work, pins or a config delta or reading everything or a gateway's inbox,
    a gateway forging a config delta, the config user reading anything: each refused."""
    nats = pytest.importorskip("nats")
    from tests.support.nats_server import free_port

    docs = render.template()
    port, mon = free_port(), free_port()
    proc = _start(_write_conf(docs, tmp_path, port, mon))

    async def violations(role: str, act) -> list[str]:
        errors: list[Exception] = []

        async def err_cb(exc: Exception) -> None:
            errors.append(exc)

        kw = {"inbox_prefix": "_INBOX_WORKER"} if role == "sidecar" else {}
        nc = await nats.connect(_url(docs, role, port), error_cb=err_cb, allow_reconnect=False, **kw)
        try:
            await act(nc)
            await nc.flush()
            for _ in range(30):
                if errors:
                    break
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        return [str(e).lower() for e in errors]

    async def scenario() -> None:
        for _ in range(100):
            try:
                probe = await nats.connect(_url(docs, "gateway", port), allow_reconnect=False)
                await probe.close()
                break
            except Exception:
                await asyncio.sleep(0.1)
        # no credentials, and a wrong password: the connection is refused
        for url in (f"nats://127.0.0.1:{port}", f"nats://sidecar:wrong@127.0.0.1:{port}"):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await asyncio.wait_for(nats.connect(url, allow_reconnect=False, connect_timeout=2), 10)
        refused = [
            ("sidecar", lambda nc: nc.publish("sie.work.default.cpu.default.m", b"x")),
            ("sidecar", lambda nc: nc.publish("sie.direct.sie.work.default.cpu.default.m", b"x")),
            ("sidecar", lambda nc: nc.publish("sie.config.models._all", b"{}")),
            ("sidecar", lambda nc: nc.publish("sie.pin.w-0", b"{}")),
            ("sidecar", lambda nc: nc.publish("$KV.SIE_POOLS.p", b"{}")),
            ("sidecar", lambda nc: nc.publish("$JS.API.STREAM.DELETE.WORK_POOL_default", b"")),
            ("sidecar", lambda nc: nc.publish("$JS.API.STREAM.UPDATE.KV_SIE_POOLS", b"{}")),
            ("sidecar", lambda nc: nc.subscribe(">")),
            ("sidecar", lambda nc: nc.subscribe("_INBOX.gateway-1.>")),
            ("gateway", lambda nc: nc.publish("sie.config.models._all", b"{}")),
            ("config", lambda nc: nc.subscribe(">")),
            ("config", lambda nc: nc.publish("sie.work.default.cpu.default.m", b"x")),
        ]
        for role, act in refused:
            errors = await violations(role, act)
            assert any("permissions violation" in e for e in errors), (role, errors)
        # what each role does is let through
        allowed = [
            ("sidecar", lambda nc: nc.publish("sie.health.w-0", b"{}")),
            ("sidecar", lambda nc: nc.publish("_INBOX.gateway-1.results", b"x")),
            ("sidecar", lambda nc: nc.subscribe("sie.direct.sie.work.default.cpu.default.m")),
            ("gateway", lambda nc: nc.publish("sie.work.default.cpu.default.m", b"x")),
            ("gateway", lambda nc: nc.subscribe("sie.health.>")),
            ("config", lambda nc: nc.publish("sie.config.models._all", b"{}")),
        ]
        for role, act in allowed:
            assert await violations(role, act) == [], role

    try:
        asyncio.run(scenario())
    finally:
        _stop(proc)


def _routes(mon: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{mon}/routez", timeout=2) as r:
        return int(json.loads(r.read())["num_routes"])


def test_three_members_authenticate_their_routes(render, tmp_path):
    """With three members a NATS route needs the route user: a server that does not know its
    password cannot join the cluster (and so reads nothing); one that knows it can."""
    from tests.support.nats_server import free_port

    docs = render.template(sets=THREE)
    sec = nats_secret(docs)
    cluster = sec["cluster.conf"]
    assert "authorization {" in cluster and "user: route" in cluster
    assert re.search(r'"nats://route:[^@"]+@sie-nats-0\.sie-nats-headless\.sie\.svc:6222"', cluster)
    port, mon, route = free_port(), free_port(), free_port()
    (tmp_path / "m").mkdir()
    conf = _write_conf(docs, tmp_path / "m", port, mon)
    # this machine's route port; its routes lead to a port where no member listens (JetStream in
    # cluster mode wants one configured, the two other members are not needed here)
    text = (tmp_path / "m" / "auth" / "cluster.conf").read_text()
    password = re.search(r'password: "([^"]+)"', text).group(1)
    text = re.sub(r"port: 6222", f"port: {route}\n      host: 127.0.0.1", text)
    text = re.sub(
        r"routes: \[[^\]]*\]",
        f'routes: ["nats://route:{password}@127.0.0.1:{free_port()}"]',
        text,
        flags=re.S,
    )
    (tmp_path / "m" / "auth" / "cluster.conf").write_text(text)
    member = _start(conf)
    procs = [member]
    try:
        for _ in range(100):
            try:
                _routes(mon)
                break
            except OSError:
                time.sleep(0.1)

        def intruder(creds: str) -> subprocess.Popen:
            from tests.support.nats_server import nats_server_binary

            p = subprocess.Popen(
                [
                    nats_server_binary(), "-a", "127.0.0.1", "-p", str(free_port()),
                    "--cluster_name", "sie-nats", "--cluster", f"nats://127.0.0.1:{free_port()}",
                    "--routes", f"nats://{creds}127.0.0.1:{route}",
                ],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(p)
            return p

        intruder("")
        intruder("route:wrong@")
        time.sleep(3)
        assert _routes(mon) == 0
        intruder(f"route:{password}@")
        deadline = time.monotonic() + 15
        while _routes(mon) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        # the check above could have seen routes (a pool of them per peer): the password is the key
        assert _routes(mon) > 0
    finally:
        _stop(*procs)


def test_tls_renders_for_clients_and_routes_and_the_generated_certificate_serves(render, tmp_path):
    """``nats.tls.enabled``: the server takes TLS on client connections and routes with a certificate
    made by the chart; the clients' URLs are tls:// and they trust its CA; a client verifying the
    server by its Service name connects over TLS to the rendered config."""
    nats = pytest.importorskip("nats")
    from tests.support.nats_server import free_port

    docs = render.template(sets={**THREE, "nats.tls.enabled": "true"})
    conf = local_nats_conf(docs, tmp_path)
    assert "tls {" in conf and "include ./auth/cluster.conf" in conf
    assert "tls {" in nats_secret(docs)["cluster.conf"]
    for role in ("gateway", "sidecar", "config"):
        assert nats_secret(docs)[f"{role}-url"].startswith("tls://")
    for d in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
        for c in pod_spec(d)["containers"]:
            if "SIE_NATS_URL" in env_of(c):
                assert env_of(c)["SSL_CERT_FILE"]["value"] == "/etc/sie/nats-ca/ca.crt"
                assert any(m["mountPath"] == "/etc/sie/nats-ca" for m in c["volumeMounts"])
    (tls_secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "sie-nats-tls"]
    certs = tmp_path / "tls"
    certs.mkdir()
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (certs / key).write_bytes(base64.b64decode(tls_secret["data"][key]))
    # one member, alone: TLS on the client port with the chart's certificate
    docs1 = render.template(sets={"nats.tls.enabled": "true"})
    port, mon = free_port(), free_port()
    proc = _start(_write_conf(docs1, tmp_path, port, mon, certs))

    async def scenario() -> None:
        ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        url = _url(docs1, "gateway", port)
        assert url.startswith("tls://")
        for _ in range(100):
            try:
                nc = await nats.connect(url, tls=ctx, tls_hostname="sie-nats.sie.svc", allow_reconnect=False)
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("no TLS connection to the rendered config")
        await nc.flush()
        await nc.close()
        # without TLS the server does not talk
        with pytest.raises(Exception):  # noqa: B017 - whichever way the handshake fails
            await asyncio.wait_for(
                nats.connect(url.replace("tls://", "nats://"), allow_reconnect=False, connect_timeout=2), 10
            )

    try:
        asyncio.run(scenario())
    finally:
        _stop(proc)


# ---------------------------------------------------------------------- NetworkPolicies
def _policy(docs: list[dict], name: str) -> dict:
    return named(docs, "NetworkPolicy", name)["spec"]


def _components(peers: list[dict]) -> set[str]:
    return {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers if "podSelector" in p
    }


def test_default_render_has_network_policies_between_the_pods(render):
    docs = render.template()
    nats = _policy(docs, "sie-nats")
    assert nats["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "nats"
    client = [r for r in nats["ingress"] if r["ports"][0]["port"] == 4222]
    assert len(client) == 1 and _components(client[0]["from"]) == {"gateway", "worker", "config"}
    assert not [r for r in nats["ingress"] if r["ports"][0]["port"] == 6222]  # one member: no routes
    monitor = [r for r in nats["ingress"] if r["ports"][0]["port"] == 8222]
    assert monitor and all(r.get("from") for r in monitor)  # never open to everyone
    config = _policy(docs, "sie-config")
    assert _components(config["ingress"][0]["from"]) == {"gateway", "worker", "config"}
    workers = _policy(docs, "sie-workers")
    assert workers["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert [p["port"] for r in workers["ingress"] for p in r["ports"]] == [9095]
    gateway = _policy(docs, "sie-gateway")
    assert gateway["ingress"] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]  # anyone, by default
    for doc in by_kind(docs, "NetworkPolicy"):
        assert doc["apiVersion"] == "networking.k8s.io/v1" and doc["spec"]["policyTypes"] == ["Ingress"]


def test_network_policy_values(render):
    docs = render.template(
        sets={
            **THREE,
            "gateway.networkPolicy.from[0].namespaceSelector.matchLabels.team": "search",
            "workers.networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name": "monitoring",
            "machineProfiles.cpu.modelProcesses": "3",
        }
    )
    nats = _policy(docs, "sie-nats")
    routes = [r for r in nats["ingress"] if r["ports"][0]["port"] == 6222]
    assert len(routes) == 1 and _components(routes[0]["from"]) == {"nats"}
    assert _policy(docs, "sie-gateway")["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "search"}}}
    ]
    workers = _policy(docs, "sie-workers")["ingress"][0]
    assert [p["port"] for p in workers["ports"]] == [9095, 9096, 9097]
    assert workers["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    assert not by_kind(render.template(sets={"networkPolicy.enabled": "false"}), "NetworkPolicy")


def test_a_change_to_the_allow_lists_rolls_the_nats_members(render, tmp_path):
    """The lists live in the auth Secret, which the pods only read at start: the members' pod
    template changes with them, so an upgrade that changes them restarts NATS."""
    import shutil

    def checksum(chart: Path) -> str:
        res = render.run("template", "sie", str(chart), "--namespace", "sie")
        assert res.returncode == 0, res.stderr
        docs = [d for d in yaml.safe_load_all(res.stdout) if d]
        sts = named(docs, "StatefulSet", "sie-nats")
        return sts["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    copy = tmp_path / "sie-cluster"
    shutil.copytree(CHART, copy)
    before = checksum(copy)
    perms = json.loads((copy / "files" / "nats-permissions.json").read_text())
    perms["sidecar"]["publish"]["allow"].append("sie.extra.>")
    (copy / "files" / "nats-permissions.json").write_text(json.dumps(perms))
    assert checksum(copy) != before
