"""A model's forward threads: the threads its forward passes run on, and the gate between them.

(The word "lane" belongs to the sidecar: a JetStream route of pool, machine profile and bundle.)

On CPU a model runs as many forwards at once as it has forward threads (``SIE_FORWARD_THREADS``,
formerly ``SIE_FORWARD_LANES``, default 1), each with an equal share of the intra-op threads.
PyTorch's intra-op threads meet at a barrier after every operation, so when another process (the
gateway, NATS, the sidecar, an HTTP client) takes one core for a moment, the thread on the other
core waits for it and the forward loses both cores; single-threaded forwards lose only what is
taken. Measured on the 2-core machine, MiniLM, 32-token sentences:

- forwards alone, batches of 8: one forward on two threads 385 items/s, two forward threads 444/s;
  with a neighbour taking 0.17 core in short bursts, 292/s against 386/s;
- ``sie serve``, two forward threads against one: 32 sentences/request × 4 clients 2–25% more, × 1
  client about the same, 1 × 16 clients 2–17% less (smaller batches), one client with one sentence
  27% less (a lone forward runs on one core);
- the cluster path (the worker beside the sidecar, gateway and NATS): 32 × 4 1–20% more, 1 × 16
  between 7% less and 10% more in different runs (README, "The cluster path beside sie serve").

So one forward thread stays the default, and a worker that shares its cores with busy neighbours,
or serves many concurrent batches, can take two. A forward thread's share of intra-op threads is set
once for the process: switching it per forward (all threads while no other forward runs) measured
slower once both thread teams existed.

On CUDA a model has one forward thread: kernels of one stream run in order anyway, and the next
batch is queued behind the running one instead (``forwards_in_flight``).

Forwards on different threads share the model's weights. A forward that changes state the others
see (activating a LoRA) runs alone: :class:`ForwardGate`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


def thread_plan(on_cuda: bool, forward_threads: int, torch_threads: int) -> tuple[int, int]:
    """(forward threads, intra-op threads of each) for a worker: one forward thread on CUDA; on CPU
    ``forward_threads``, the torch threads shared among them."""
    if on_cuda:
        return 1, torch_threads
    forward_threads = max(1, forward_threads)
    return forward_threads, max(1, torch_threads // forward_threads)


class ForwardGate:
    """Forwards hold the gate together (``shared``); a change of the model's state (a LoRA loaded,
    unloaded or active, the model unloaded) holds it alone (``exclusive``). A waiting exclusive
    holder keeps new shared ones out, so a LoRA load is not starved by a stream of forwards. A
    thread that holds it shared may take it shared again (a forward run inside another, between two
    of its layers: worker/batching/preemption.py) without waiting."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self._local = threading.local()  # .depth: how many times this thread holds it shared

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = depth
            return
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._shared += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
