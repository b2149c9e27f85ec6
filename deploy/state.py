"""Where a ``sie up`` keeps its state, and how the other commands find it.

``sie up`` owns a state directory (JetStream store, SQLite, logs, admin token, ``status.json``)
and holds ``sie-up.lock`` in it while it runs, so a second ``sie up`` on the same directory is
refused before it opens anything. It also records the directory's path in
``$XDG_STATE_HOME/sie-cluster/last-up`` (default ``~/.local/state``), so that ``sie status``,
``sie down``, ``sie logs`` and ``sie models add`` run from any directory find the cluster: an
explicit ``--state-dir`` first, then ``./.sie-state``, then the last ``sie up`` recorded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from deploy.supervisor import pid_alive, read_status

DEFAULT_STATE_DIR = ".sie-state"
LOCK_FILE = "sie-up.lock"


def sie_command(
    which: Callable[[str], str | None] = shutil.which,
    executable: str | None = None,
    cwd: Path | None = None,
) -> str:
    """``sie`` as a hint should print it, so that it runs when pasted: ``sie`` when that name on PATH
    is this installation's; else this installation's script by path, relative to the working
    directory when beneath it (``.venv/bin/sie`` after ``make up``), else absolute; without a
    script (a checkout on PYTHONPATH), ``python -m deploy.cli``."""
    python = Path(executable or sys.executable)
    script = python.parent / "sie"
    if not script.exists():
        return f"{shlex.quote(str(python))} -m deploy.cli"
    found = which("sie")
    if found and Path(found).resolve() == script.resolve():
        return "sie"
    here = (cwd or Path.cwd()).absolute()
    try:
        rel = script.absolute().relative_to(here)
    except ValueError:
        return shlex.quote(str(script.absolute()))
    return shlex.quote(str(rel) if len(rel.parts) > 1 else f"./{rel}")


class NoCluster(Exception):
    """No running ``sie up`` could be found; the message says where we looked and what to pass."""


def pointer_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sie-cluster" / "last-up"


def remember(state_dir: Path) -> None:
    """Record ``state_dir`` as the last ``sie up``'s (best effort: a read-only home is not fatal)."""
    with contextlib.suppress(OSError):
        path = pointer_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(state_dir))


def running(state_dir: Path) -> bool:
    doc = read_status(state_dir)
    return doc is not None and pid_alive(doc.get("supervisor_pid"))


def find_state_dir(explicit: str | None) -> Path:
    """The state directory of the ``sie up`` a command talks to. Raises NoCluster."""
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if read_status(path) is None:
            raise NoCluster(f"{path} is not the state directory of a sie up (no {path / 'status.json'})")
        return path
    candidates = [Path(DEFAULT_STATE_DIR).resolve()]
    with contextlib.suppress(OSError):
        candidates.append(Path(pointer_path().read_text().strip()))
    for path in candidates:
        if running(path):
            return path
    for path in candidates:  # none running: the newest that exists, so `sie logs` still reads it
        if read_status(path) is not None:
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise NoCluster(
        f"no sie up found (looked in {looked}): start one with `{sie_command()} up`, or pass --state-dir DIR "
        "(the directory `sie up --state-dir` was given)"
    )


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``host:port`` cannot be bound (another process listens there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def take_lock(state_dir: Path) -> IO[str] | None:
    """Hold ``sie-up.lock`` in ``state_dir`` for this process's life; None when another holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    handle = open(state_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open while sie up runs
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
