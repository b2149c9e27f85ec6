"""Interactive work run inside a running bulk forward, between two blocks of its layers (CPU).

On a CPU worker a model has one forward thread, and a bulk batch on it holds it for the whole
forward: an interactive batch that arrives meanwhile waits for the end of it (on 2 cores, MiniLM,
the Batch API beside single-text requests: the interactive p50 went from 11 ms idle to 35 ms).
With :class:`Preemption` the interactive batch is handed to the running bulk forward instead: a
pre-hook on each of the model's layers runs what is waiting, on the same thread (the same
intra-op thread team, so the two never compete for the cores), and the bulk forward then goes on
from the layer it stopped at. The wait becomes one block's time (a layer's attention, or a half of
its feed-forward) instead of a whole forward's.

After interactive work, a bulk forward keeps quiet for a moment (``SIE_PREEMPT_QUIET_MS``): at its
next block it waits that long for more interactive work before it goes on. A client that sends one
request after another then finds the cores free when its next request arrives, instead of busy with
bulk threads that the path's processes (gateway, sidecar, NATS) also wait behind on the way in and
out.

While interactive work keeps coming (``SIE_PREEMPT_SPARE_CORE_MS`` after the last of it), a bulk
forward runs on one intra-op thread fewer, and the work run inside it on all of them: the core left
over carries the next request in and the last answer out through those processes, where two bulk
threads would have taken both cores.

Bulk is never starved: interactive work, and the quiet waits, take at most ``max_share`` of a bulk
forward's time this way (``SIE_PREEMPT_MAX_SHARE``, 0.9); past that it waits for the forward's end,
as it did without preemption. Below that, bulk gets what interactive work leaves: beside a client
that sends one text after another (its forwards alone keep the worker about two thirds busy), a
Batch API batch ran at 25-29 texts/s instead of about 100, and the client's p99 stayed within
1.04-1.71x of its idle p99 instead of 1.8-2.3x (2 cores, docs/benchmarks/2026-11-26-batch.md).

Running a forward inside another is safe for eager PyTorch modules, which keep no state between
the calls of one forward; a model whose forwards share state (a LoRA active) does not preempt
(the hook looks each time). Whatever no layer picks up (the bulk forward ended first, or the model
has no layers to hook) runs on the forward thread after the bulk forward, as before.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

# attribute paths of the stack of layers in the transformers families we load (BERT-likes,
# RoBERTa, XLM-R, ModernBERT, T5 encoders); the first found is hooked. Encoders that call their
# layers' weights themselves (worker/modeling: the packed forward, gte_new) never reach the hooks:
# their interactive work runs after the bulk forward, as without preemption.
LAYER_STACKS = ("encoder.layer", "layers", "encoder.layers", "encoder.block", "transformer.layer")


def layer_stack(model: Any) -> list[Any]:
    """The layers of ``model`` (a torch module, or an adapter's wrapper of one) to hook: its stack of
    transformer layers, found by the usual attribute paths in it or in its ``base_model``."""
    for root in (model, getattr(model, "base_model", None), getattr(model, "model", None)):
        if root is None:
            continue
        for path in LAYER_STACKS:
            node = root
            for name in path.split("."):
                node = getattr(node, name, None)
                if node is None:
                    break
            layers = list(node) if node is not None and hasattr(node, "__iter__") else []
            if len(layers) > 1 and all(hasattr(m, "register_forward_pre_hook") for m in layers):
                return layers
    return []


def layer_blocks(layer: Any) -> list[Any]:
    """The blocks of one layer to hook beside it: its direct children that hold weights and are
    called (a ModuleList or ModuleDict only holds modules; its hook would never run)."""
    from torch import nn

    return [
        child
        for child in layer.children()
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict))
        and next(child.parameters(), None) is not None
    ]


class Preemption:
    """One model's waiting interactive work and the hooks that run it inside a bulk forward."""

    def __init__(
        self,
        allowed: Callable[[], bool] = lambda: True,
        max_share: float = 0.5,
        on_preempt: Callable[[], None] = lambda: None,
        quiet_s: float = 0.0,
        threads: int = 1,
        set_threads: Callable[[int], None] = lambda n: None,
        spare_core_s: float = 0.0,
    ) -> None:
        """``allowed()``: whether a forward may run inside another now (asked at each layer);
        ``max_share``: the most of a bulk forward's time the work run inside it (and its quiet waits)
        may take; ``on_preempt()``: called (on the forward thread) for each call run inside one;
        ``quiet_s``: how long after interactive work a bulk forward waits for more at its next block;
        ``threads``: the intra-op threads of the forward thread; ``set_threads(n)`` sets torch's
        count, which is the whole process's: it is asked at every block of a bulk forward, not
        remembered, since another model's bulk forward may have changed it (a no-op where the count
        is ``n`` already);
        ``spare_core_s``: how long after interactive work a bulk forward runs on one thread fewer."""
        self.allowed = allowed
        self.max_share = max_share
        self.on_preempt = on_preempt
        self.quiet_s = quiet_s
        self.threads = threads
        self.set_threads = set_threads
        self.spare_core_s = spare_core_s
        self._last_interactive = float("-inf")  # perf_counter time of the newest interactive work
        self.hooked_layers = 0
        self._waiting: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()
        self._lock = threading.Lock()
        self._arrived = threading.Event()  # set when interactive work is handed over (ends a quiet wait)
        self._quiet_until = 0.0  # perf_counter time until which bulk waits for interactive work
        self._bulk = 0  # bulk calls handed to the forward thread and not ended
        self._local = threading.local()  # .in_bulk: this thread is in a bulk forward's layers

    def install(self, model: Any) -> int:
        """Hook the layers of ``model``, and inside each the blocks it calls (attention, the two
        halves of the feed-forward: its direct children that hold weights), so that what waits runs
        after a block of the bulk forward rather than a whole layer; returns how many layers (0:
        nothing to preempt at)."""
        layers = layer_stack(model)
        for layer in layers:
            layer.register_forward_pre_hook(self._at_layer)
            for block in layer_blocks(layer):
                block.register_forward_pre_hook(self._at_layer)
        self.hooked_layers = len(layers)
        return self.hooked_layers

    @property
    def bulk_running(self) -> bool:
        """Whether a bulk call is on (or queued for) the forward thread now."""
        return self._bulk > 0

    def bulk(self, executor: Executor, call: Callable[[], T]) -> Future[T]:
        """Run ``call`` on ``executor`` (the forward thread) as a bulk call: counted from now until
        it ends or is cancelled, and its layers run the interactive work waiting."""

        def run() -> T:
            self._local.in_bulk = True
            self._local.started = time.perf_counter()
            self._local.lent = 0.0  # seconds of this bulk call spent on work run inside it
            self.set_threads(self._bulk_threads())
            try:
                return call()
            finally:
                self._local.in_bulk = False
                self.set_threads(self.threads)

        def done(_: Future[T]) -> None:
            with self._lock:
                self._bulk -= 1

        with self._lock:
            self._bulk += 1
        try:
            future = executor.submit(run)
        except BaseException:
            done(Future())
            raise
        future.add_done_callback(done)
        return future

    def submit(self, executor: Executor, call: Callable[[], T]) -> Future[T]:
        """Hand ``call`` to the next layer of the running bulk forward, and queue :meth:`run_waiting`
        on ``executor`` (the forward thread) to run it after that forward if no layer did."""
        future: Future[T] = Future()
        self._last_interactive = time.perf_counter()
        with self._lock:
            self._waiting.append((call, future))
        self._arrived.set()
        try:
            executor.submit(self.run_waiting)
        except BaseException:
            future.cancel()
            raise
        return future

    def run_waiting(self, most: int | None = None) -> None:
        """Run the calls waiting (at most ``most``; None: until none is left), on this thread, each
        once (as a plain call: its layers do not preempt it)."""
        was_bulk = getattr(self._local, "in_bulk", False)
        self._local.in_bulk = False
        try:
            while most is None or most > 0:
                with self._lock:
                    if not self._waiting:
                        return
                    call, future = self._waiting.popleft()
                if most is not None:
                    most -= 1
                if not future.set_running_or_notify_cancel():
                    continue
                if was_bulk:
                    self.on_preempt()
                    self.set_threads(self.threads)
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(exc)
                self.interactive_ended()
        finally:
            self._local.in_bulk = was_bulk
            if was_bulk:
                self.set_threads(self._bulk_threads())

    def interactive_ended(self) -> None:
        """Interactive work has just ended on the forward thread: bulk keeps quiet from now, and
        spares a core for a while."""
        now = time.perf_counter()
        self._last_interactive = now
        self._quiet_until = now + self.quiet_s

    def _bulk_threads(self) -> int:
        """The intra-op threads a bulk forward runs on now: one fewer while interactive work keeps
        coming."""
        if self.threads > 1 and time.perf_counter() < self._last_interactive + self.spare_core_s:
            return self.threads - 1
        return self.threads

    def _at_layer(self, module: Any, args: Any) -> None:
        if not getattr(self._local, "in_bulk", False):
            return
        self.set_threads(self._bulk_threads())
        if not self._waiting and not self._quiet_wait():
            return
        now = time.perf_counter()
        lent = self._local.lent
        if lent > self.max_share * (now - self._local.started) or not self.allowed():
            return  # the bulk call's share is spent: what waits runs after it
        self.run_waiting(most=len(self._waiting))  # what came meanwhile asks again at the next layer
        self._local.lent = lent + time.perf_counter() - now

    def _quiet_wait(self) -> bool:
        """Inside the quiet window after interactive work (and within the bulk call's share): wait
        for more, up to the window's end; whether some arrived. The wait counts as lent time."""
        now = time.perf_counter()
        rest = self._quiet_until - now
        if rest <= 0 or not self.allowed():
            return False
        local = self._local
        if local.lent + rest > self.max_share * (now - local.started + rest):
            return False  # waiting that long would take more than the bulk call's share
        self._arrived.clear()
        if not self._waiting:  # checked after the clear: a hand-over from now on sets it again
            self._arrived.wait(rest)
        local.lent += time.perf_counter() - now
        return bool(self._waiting)
