"""deploy/compose/compose.yaml runs the same processes with the same settings as the chart."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helm.test_chart import CONTAINER_ENV, NON_SIE, SETTINGS_FOR

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "compose.yaml"
DOCKER = COMPOSE.parents[1] / "docker"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_env_is_what_the_code_reads(monkeypatch):
    svcs = services()
    assert {"nats", "config", "gateway", "worker", "sidecar"} <= set(svcs)
    for name in ("config", "gateway", "worker", "sidecar"):
        env = {k: str(v) for k, v in svcs[name]["environment"].items()}
        known = CONTAINER_ENV[name]()
        for key in env:
            assert key in known or key in NON_SIE, f"compose {name} sets {key}, which no code reads"
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v.replace("${SIE_ADMIN_TOKEN:-change-me-admin-token}", "t").replace("${SIE_PRELOAD_MODELS:-}", ""))
            SETTINGS_FOR[name]()


def test_compose_worker_pod_shares_the_socket():
    svcs = services()
    side, work = svcs["sidecar"], svcs["worker"]
    path = side["environment"]["SIE_IPC_SOCKET_PATH"]
    assert work["environment"]["SIE_IPC_SOCKET_PATH"] == path
    assert side["environment"]["SIE_WORKER_ID"] == work["environment"]["SIE_WORKER_ID"]
    sock_dir = str(Path(path).parent)
    assert f"ipc:{sock_dir}" in side["volumes"] and f"ipc:{sock_dir}" in work["volumes"]
    assert yaml.safe_load(COMPOSE.read_text())["volumes"]["ipc"]["driver_opts"]["type"] == "tmpfs"


def test_dockerfiles_install_the_probe_and_run_as_non_root():
    for name in ("Dockerfile.worker", "Dockerfile.service"):
        text = (DOCKER / name).read_text()
        assert "COPY deploy/docker/sie_probe.py /usr/local/bin/sie-probe" in text
        assert "USER 1000:1000" in text
    # the compose and chart commands name modules that exist
    root = COMPOSE.parents[2]
    for svc in services().values():
        cmd = svc.get("command") or []
        if cmd[:2] == ["python", "-m"]:
            mod = cmd[2].replace(".", "/")
            assert (root / f"{mod}.py").exists() or (root / mod / "__main__.py").exists(), cmd
