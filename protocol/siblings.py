"""A pod's model processes: the first process of a container starts its siblings and keeps them running.

One Python process cannot keep a GPU busy with small encoders (its one GIL tokenises, launches
kernels and encodes answers), so a worker pod runs ``SIE_MODEL_PROCESSES`` whole workers on its
device, and its sidecar container as many sidecars, one per worker process. Process 0 of each
container is the one Kubernetes (or ``sie up``) starts; it starts processes 1..N-1 with
``SIE_PROCESS_INDEX`` set, restarts one that exits, and stops them when it stops. A sibling receives
SIGTERM when process 0 dies, however it died (PR_SET_PDEATHSIG), so a restarted container never finds
the last one's siblings still running.

Process ``i`` of a pod is named from the pod's own settings: its IPC socket (:func:`process_socket`)
and its worker id (:func:`process_worker_id`), so the worker and the sidecar of one index find each
other without being told.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import PurePosixPath

log = logging.getLogger("sie.siblings")

# a sibling that ran this long before it exited is restarted at once; sooner, after a delay that
# doubles from RESTART_DELAY_S up to RESTART_DELAY_MAX_S
STEADY_S = 60.0
RESTART_DELAY_S = 1.0
RESTART_DELAY_MAX_S = 30.0


def process_socket(path: str, index: int) -> str:
    """The IPC socket of model process ``index``: ``path`` itself for 0, ``ipc.p2.sock`` beside
    ``ipc.sock`` for 2."""
    if index == 0:
        return path
    p = PurePosixPath(path)
    return str(p.with_name(f"{p.stem}.p{index}{p.suffix}"))


def process_worker_id(worker_id: str, index: int) -> str:
    """The worker id of model process ``index`` (heartbeats, results, pins): the pod's for 0,
    ``<pod>-p2`` for 2."""
    return worker_id if index == 0 else f"{worker_id}-p{index}"


def _die_with_parent() -> None:
    """Child side of fork: receive SIGTERM when process 0 dies (Linux), however it died."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Siblings:
    """Processes 1..count-1 of ``python -m module`` with ``env`` added to this one's environment
    (and ``SIE_PROCESS_INDEX``), kept running."""

    def __init__(self, module: str, count: int, env: Mapping[str, str] | None = None) -> None:
        self.module = module
        self.indexes = list(range(1, count))
        self.env = {**os.environ, **(env or {})}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts = 0
        self._started_at: dict[int, float] = {}
        self._delay: dict[int, float] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def _spawn(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", self.module],
            env={**self.env, "SIE_PROCESS_INDEX": str(index)},
            preexec_fn=_die_with_parent,
        )
        self._started_at[index] = time.monotonic()

    def start(self) -> Siblings:
        with self._lock:
            for index in self.indexes:
                self._spawn(index)
        if self.indexes:
            self._watcher = threading.Thread(target=self._watch, name="siblings", daemon=True)
            self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            with self._lock:
                for index, proc in list(self.procs.items()):
                    if self._stopping.is_set() or proc.poll() is None:
                        continue
                    ran = time.monotonic() - self._started_at[index]
                    delay = 0.0 if ran >= STEADY_S else self._delay.get(index, RESTART_DELAY_S)
                    if ran < delay:
                        continue  # not yet: it exited soon after its last start
                    log.warning(
                        "%s process %d exited (code %s) after %.1f s; restarting it",
                        self.module,
                        index,
                        proc.returncode,
                        ran,
                    )
                    self._delay[index] = (
                        RESTART_DELAY_S if ran >= STEADY_S else min(RESTART_DELAY_MAX_S, delay * 2)
                    )
                    self.restarts += 1
                    self._spawn(index)

    def terminate(self) -> None:
        """SIGTERM to every sibling (each drains as process 0 does); none is restarted from now on."""
        self._stopping.set()
        with self._lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for them all to exit; SIGKILL what is left."""
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.terminate()
        self.wait(timeout_s)
