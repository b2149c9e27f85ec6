"""deploy/compose/compose.yaml runs the same processes with the same settings as the chart."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helm.test_chart import CONTAINER_ENV, NON_SIE, SETTINGS_FOR
from worker import POD_OMP_SPINCOUNT

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
                m.setenv(
                    k,
                    v.replace("${SIE_ADMIN_TOKEN:-change-me-admin-token}", "t").replace(
                        "${SIE_PRELOAD_MODELS:-}", ""
                    ),
                )
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
    assert work["environment"]["GOMP_SPINCOUNT"] == POD_OMP_SPINCOUNT  # as under the chart and sie up


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


def test_images_carry_every_deploy_module_the_sie_command_imports():
    import ast
    import fnmatch

    root = COMPOSE.parents[2]
    needed, todo = set(), ["deploy/cli.py"]
    while todo:
        path = todo.pop()
        if path in needed:
            continue
        needed.add(path)
        for node in ast.walk(ast.parse((root / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deploy."):
                todo.append(node.module.replace(".", "/") + ".py")
    assert {
        "deploy/state.py",
        "deploy/commands.py",
    } <= needed  # `sie serve` checks its port with deploy.state
    for name in ("Dockerfile.worker", "Dockerfile.service"):
        sources = [
            src
            for line in (DOCKER / name).read_text().splitlines()
            if line.startswith("COPY deploy")
            for src in line.split()[1:-1]
        ]
        missing = [p for p in sorted(needed) if not any(fnmatch.fnmatch(p, s) for s in sources)]
        assert not missing, f"{name} lacks {missing}"
