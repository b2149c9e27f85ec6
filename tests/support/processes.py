"""Killing what a test started, and nothing else.

Process ids come back quickly here (``kernel.pid_max`` is 32768 and a parallel run starts
thousands of processes), so a pid recorded earlier in a test may by teardown name another test's
process. A process is named by its pid and its start time (``/proc/<pid>/stat``, field 22): a
teardown kills a recorded process only while both still match.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

Identity = tuple[int, int]  # (pid, start time in clock ticks since boot)


def identity(pid: int) -> Identity | None:
    """``pid`` with its start time; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return pid, int(fields[19])  # field 22 of the whole line: starttime


def identities(pids: Iterable[int]) -> set[Identity]:
    return {i for pid in pids if pid and (i := identity(pid)) is not None}


def kill_if_same(recorded: Iterable[Identity], sig: int = signal.SIGKILL) -> None:
    """Signal each recorded process that still runs as the same process (pid and start time)."""
    for pid, started in recorded:
        if identity(pid) == (pid, started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def ctrl_c_at_default() -> None:
    """``preexec_fn`` of a process a test stops with SIGINT, as Ctrl-C would: SIGINT at its default.
    A shell without job control starts a background command with SIGINT ignored (``make test &`` in
    a script), every child inherits that, and Python then keeps ignoring it: ``sie up`` would never
    see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(proc: subprocess.Popen | None, grace: float, sig: int = signal.SIGTERM) -> None:
    """``sig`` to ``proc`` while it runs, and SIGKILL if it has not exited ``grace`` seconds later."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def children(pid: int) -> list[int]:
    """The child processes of every thread of ``pid`` (a child started from a thread other than the
    main one is listed under that thread's task)."""
    return [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
