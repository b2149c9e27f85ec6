"""The config file of ``sie up --nats-replicas 3``'s members (deploy/launcher.py): one file that
every member reads as it starts, so a later member's command line must not rewrite it in place."""

from __future__ import annotations

from pathlib import Path

from deploy.launcher import ROUTE_PINGS, Cluster


def conf_of(cmd: list[str]) -> str:
    return cmd[cmd.index("-c") + 1]


def test_the_next_members_command_leaves_the_config_file_the_first_reads_alone(tmp_path):
    cluster = Cluster(state_dir=tmp_path, nats_replicas=3)
    path = conf_of(cluster.nats_command(0))
    before = (tmp_path / "jetstream" / "cluster.conf").stat()
    assert conf_of(cluster.nats_command(1)) == conf_of(cluster.nats_command(2)) == path
    after = (tmp_path / "jetstream" / "cluster.conf").stat()
    # not truncated and written again while member 0 may be reading it
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert Path(path).read_text() == ROUTE_PINGS


def test_a_stale_config_file_is_replaced_whole(tmp_path):
    cluster = Cluster(state_dir=tmp_path, nats_replicas=3)
    stale = tmp_path / "jetstream" / "cluster.conf"
    stale.parent.mkdir(parents=True)
    stale.write_text("cluster {}\n")
    inode = stale.stat().st_ino
    cluster.nats_command(0)
    assert stale.read_text() == ROUTE_PINGS
    assert stale.stat().st_ino != inode  # a new file renamed over the old one, never a partial one
    assert [p.name for p in stale.parent.iterdir()] == ["cluster.conf"]  # no temporary file left
