"""The config file of ``sie up``'s NATS members (deploy/launcher.py): the users with the chart's
allow-lists, the route user with several members; one file that every member reads as it starts,
so a later member's command line must not rewrite it in place; readable by its owner alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

from deploy.launcher import ROUTE_PINGS, Cluster, nats_server_binary
from protocol.nats_permissions import ROLES


def conf_of(cmd: list[str]) -> str:
    return cmd[cmd.index("-c") + 1]


def test_the_next_members_command_leaves_the_config_file_the_first_reads_alone(tmp_path):
    cluster = Cluster(state_dir=tmp_path, nats_replicas=3)
    path = conf_of(cluster.nats_command(0))
    before = (tmp_path / "jetstream" / "nats.conf").stat()
    assert conf_of(cluster.nats_command(1)) == conf_of(cluster.nats_command(2)) == path
    after = (tmp_path / "jetstream" / "nats.conf").stat()
    # not truncated and written again while member 0 may be reading it
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert Path(path).read_text() == cluster.nats_conf()
    assert ROUTE_PINGS in cluster.nats_conf()


def test_a_stale_config_file_is_replaced_whole(tmp_path):
    cluster = Cluster(state_dir=tmp_path, nats_replicas=3)
    stale = tmp_path / "jetstream" / "nats.conf"
    stale.parent.mkdir(parents=True)
    stale.write_text("cluster {}\n")
    inode = stale.stat().st_ino
    cluster.nats_command(0)
    assert stale.read_text() == cluster.nats_conf()
    assert stale.stat().st_ino != inode  # a new file renamed over the old one, never a partial one
    assert [p.name for p in stale.parent.iterdir()] == ["nats.conf"]  # no temporary file left


def test_users_passwords_and_routes_stay_off_the_command_line_and_the_file_is_0600(tmp_path):
    for replicas in (1, 3):
        cluster = Cluster(state_dir=tmp_path / str(replicas), nats_replicas=replicas)
        cmd = cluster.nats_command(0)
        conf = Path(conf_of(cmd))
        assert conf.stat().st_mode & 0o777 == 0o600
        text = conf.read_text()
        for role in ROLES:
            assert f'"user": "{role}"' in text
            password = (cluster.state_dir / "nats" / f"{role}-password").read_text()
            assert (cluster.state_dir / "nats" / f"{role}-password").stat().st_mode & 0o777 == 0o600
            assert password in text and not any(password in arg for arg in cmd)
            assert f"{role}:{password}@127.0.0.1" in cluster.nats_url_for(role)
        assert "--routes" not in cmd
        if replicas == 3:
            assert "user: route" in text and text.count('"nats://route:') == 3
        else:
            assert "cluster {" not in text
        check = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_each_client_kind_gets_its_own_nats_user(tmp_path):
    cluster = Cluster(state_dir=tmp_path)
    for kind in ("gateway", "sidecar", "config"):
        assert cluster.tokens_for(kind)["SIE_NATS_URL"] == cluster.nats_url_for(kind)
    for kind in ("worker", "other"):
        assert "SIE_NATS_URL" not in cluster.tokens_for(kind)
    assert "@" not in cluster.env()["SIE_NATS_URL"]  # the default every child gets carries no password
