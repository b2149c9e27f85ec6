"""Things built once and shared by every pytest worker of a run (``pytest -n``, pytest-xdist).

``locked(path)`` holds an exclusive ``fcntl`` lock on ``path`` (created if missing) for a ``with``
block: the workers of a run, or two runs in the same checkout, take turns.

``build_once(tmp_path_factory, name, build)`` runs ``build(folder)`` in the first worker that asks
and gives the others what it returned, once it returned: the folder lives beside the workers' own
temporary folders (the run's base folder, so the next run starts fresh; without xdist the session's
own), and the others wait on the lock while it is built.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def run_root(tmp_path_factory: Any) -> Path:
    """The folder every worker of this run sees: the parent of the workers' base folders under
    xdist (``.../pytest-N/popen-gw0`` → ``.../pytest-N``), else this session's base folder."""
    base = Path(tmp_path_factory.getbasetemp())
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory: Any, name: str, build: Callable[[Path], Any]) -> Any:
    """What ``build(folder)`` returned, for ``name``: ``build`` runs once per run, in a folder of
    its own that it may write paths of into files (it is not moved after), and what it returns
    must pickle (paths, strings, numbers) so that the other workers get it too."""
    root = run_root(tmp_path_factory) / "shared"
    folder = root / name
    done = root / f"{name}.done"
    with locked(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir(parents=True)
            value = build(folder)
            done.write_bytes(pickle.dumps(value))
        return pickle.loads(done.read_bytes())
