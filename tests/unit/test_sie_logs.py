"""``sie logs`` over a state directory: every process's log in start order, replicas included."""

from __future__ import annotations

import io
import json

from deploy.commands import logs


def _state(tmp_path, names):
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    for name in names:
        (state / "logs" / f"{name}.log").write_text(f"{name} says hello\n")
    (state / "status.json").write_text(json.dumps({"supervisor_pid": None, "children": []}))
    return state


def test_all_logs_come_in_start_order_with_replicas_after_their_first(tmp_path):
    names = [
        "gateway-2",
        "sidecar-2",
        "worker-10",
        "worker",
        "nats",
        "gateway",
        "worker-2",
        "sidecar",
        "config",
        "sie-up",
        "notes",
    ]
    state = _state(tmp_path, names)
    out = io.StringIO()
    assert logs(str(state), None, follow=False, out=out) == 0
    shown = [line.split("|")[0].strip() for line in out.getvalue().splitlines()]
    # sie up's own log and strangers are not processes of the cluster
    assert shown == [
        "nats",
        "config",
        "worker",
        "worker-2",
        "worker-10",
        "sidecar",
        "sidecar-2",
        "gateway",
        "gateway-2",
    ]
    assert all(
        line.split("|")[1] == f" {line.split('|')[0].strip()} says hello"
        for line in out.getvalue().splitlines()
    )


def test_one_replica_by_name_and_unknown_names_refused(tmp_path, capsys):
    state = _state(tmp_path, ["worker", "worker-2"])
    out = io.StringIO()
    assert logs(str(state), "worker-2", follow=False, out=out) == 0
    assert out.getvalue() == "worker-2 says hello\n"
    assert logs(str(state), "wroker-2", follow=False, out=io.StringIO()) == 1
    assert "unknown process 'wroker-2'" in capsys.readouterr().err
    assert logs(str(state), "worker-3", follow=False, out=io.StringIO()) == 1
    assert "no log at" in capsys.readouterr().err
