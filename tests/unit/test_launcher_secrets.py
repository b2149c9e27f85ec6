"""``sie up``'s secrets: each child holds only the tokens its kind uses, and the token files are
0600 from the moment they exist."""

from __future__ import annotations

import os
import stat
import sys
import threading

import pytest

from deploy.launcher import SECRET_VARS, Cluster, child_kind, state_token, token_lines, write_secret

PY = sys.executable
COMMANDS = {
    "nats": ["/usr/bin/nats-server", "-a", "127.0.0.1", "-p", "4250", "-js"],
    "config": [PY, "-m", "config_service"],
    "gateway": [PY, "-m", "gateway"],
    "sidecar": [PY, "-m", "sidecar"],
    "worker": [PY, "-m", "worker.ipc"],
}
TOKEN_VARS = ("SIE_ADMIN_TOKEN", "SIE_CONFIG_READ_TOKEN", "SIE_CONFIG_SERVICE_TOKEN", "SIE_POOL_ADMIN_TOKEN")


@pytest.fixture(autouse=True)
def no_operator_tokens(monkeypatch):
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)


def secrets_of(env: dict[str, str], cluster: Cluster) -> dict[str, str]:
    """The variables of ``env`` that hold one of ``cluster``'s tokens, or are secret by name."""
    tokens = set(vars(cluster.tokens()).values())
    return {k: v for k, v in env.items() if k in SECRET_VARS or v in tokens}


def test_each_child_kind_holds_only_its_own_secrets(tmp_path):
    cluster = Cluster(state_dir=tmp_path)
    tokens = cluster.tokens()
    assert len({tokens.admin, tokens.config_read, tokens.pool_admin}) == 3  # three different secrets
    got = {kind: secrets_of(cluster.child_env(cmd), cluster) for kind, cmd in COMMANDS.items()}
    assert got == {
        "nats": {},
        "config": {"SIE_ADMIN_TOKEN": tokens.admin, "SIE_CONFIG_READ_TOKEN": tokens.config_read},
        "gateway": {"SIE_ADMIN_TOKEN": tokens.pool_admin, "SIE_CONFIG_SERVICE_TOKEN": tokens.config_read},
        "sidecar": {"SIE_CONFIG_SERVICE_TOKEN": tokens.config_read},
        "worker": {},
    }
    # what every child shares carries no secret at all
    assert secrets_of(cluster.env(), cluster) == {}


def test_the_read_token_opens_what_gateways_and_sidecars_call_and_no_write(tmp_path):
    """The config service's own auth rule, with the tokens sie up hands out: the gateways' and
    sidecars' token reads (export, epoch, bundles, models), never writes; the config service's admin
    token writes; the gateway's pool-admin token opens nothing there."""
    from config_service.app import EXPORT, READ, WRITE, Auth, check_auth

    cluster = Cluster(state_dir=tmp_path)
    config = cluster.tokens_for("config")
    auth = Auth(admin_token=config["SIE_ADMIN_TOKEN"], read_token=config["SIE_CONFIG_READ_TOKEN"])
    for kind in ("gateway", "sidecar"):
        token = cluster.tokens_for(kind)["SIE_CONFIG_SERVICE_TOKEN"]
        for route in (READ, EXPORT):
            assert check_auth(auth, route, f"Bearer {token}") is None, (kind, route)
        assert check_auth(auth, WRITE, f"Bearer {token}").status == 403
    pool_admin = cluster.tokens_for("gateway")["SIE_ADMIN_TOKEN"]
    assert check_auth(auth, READ, f"Bearer {pool_admin}").status == 403
    assert check_auth(auth, WRITE, f"Bearer {config['SIE_ADMIN_TOKEN']}") is None


def test_operator_tokens_go_to_their_children_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_ADMIN_TOKEN", "op-admin")
    monkeypatch.setenv("SIE_POOL_ADMIN_TOKEN", "op-pools")
    monkeypatch.setenv("SIE_CONFIG_READ_TOKEN", "op-read")
    monkeypatch.setenv("SIE_AUTH_TOKENS", "op-inference")
    monkeypatch.setenv("SIE_API_KEY", "op-client-key")
    cluster = Cluster(state_dir=tmp_path)
    envs = {kind: cluster.child_env(cmd) for kind, cmd in COMMANDS.items()}
    assert envs["config"]["SIE_ADMIN_TOKEN"] == "op-admin"
    assert envs["gateway"]["SIE_ADMIN_TOKEN"] == "op-pools"
    assert envs["gateway"]["SIE_AUTH_TOKENS"] == "op-inference"
    assert envs["sidecar"]["SIE_CONFIG_SERVICE_TOKEN"] == "op-read"
    for kind in ("nats", "worker"):
        assert not any(k in envs[kind] for k in SECRET_VARS), kind
    for kind in ("config", "sidecar", "worker", "nats"):
        assert "SIE_AUTH_TOKENS" not in envs[kind] and "SIE_API_KEY" not in envs[kind]
    assert not any((tmp_path / name).exists() for name in ("admin-token", "pool-admin-token"))
    assert "from SIE_POOL_ADMIN_TOKEN" in token_lines(tmp_path)


def test_child_kinds_from_the_command_line():
    assert {kind: child_kind(cmd) for kind, cmd in COMMANDS.items()} == {
        "nats": "other",
        "config": "config",
        "gateway": "gateway",
        "sidecar": "sidecar",
        "worker": "worker",
    }
    assert child_kind([PY, "-m"]) == "other"


def test_token_files_are_0600_from_creation_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        seen: list[int] = []
        real_open = os.open

        def spy(path, flags, mode=0o777, *args, **kwargs):
            fd = real_open(path, flags, mode, *args, **kwargs)
            seen.append(stat.S_IMODE(os.fstat(fd).st_mode))  # the mode the file was born with
            return fd

        os.open = spy
        try:
            token = state_token(tmp_path / "state", "pool-admin-token", "SIE_POOL_ADMIN_TOKEN")
        finally:
            os.open = real_open
        assert seen == [0o600]
        path = tmp_path / "state" / "pool-admin-token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text() == token and len(token) >= 32
        assert list((tmp_path / "state").iterdir()) == [path]  # no temporary file left behind
        # generated once: the next call reads it back
        assert state_token(tmp_path / "state", "pool-admin-token", "SIE_POOL_ADMIN_TOKEN") == token
        # one widened by hand is narrowed again
        path.chmod(0o644)
        state_token(tmp_path / "state", "pool-admin-token", "SIE_POOL_ADMIN_TOKEN")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for name in ("admin-token", "config-read-token", "pool-admin-token"):
            Cluster(state_dir=tmp_path / "cluster").tokens()
            assert stat.S_IMODE((tmp_path / "cluster" / name).stat().st_mode) == 0o600, name
    finally:
        os.umask(old)


def test_racing_writers_agree_on_one_token(tmp_path):
    path = tmp_path / "admin-token"
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(write_secret(path, f"token-{i}")))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1  # the first one made it; the others found it there
    assert path.read_text().startswith("token-")
    assert not write_secret(path, "late")
    assert path.read_text() != "late"
