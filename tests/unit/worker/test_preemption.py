"""Preemption: interactive work run inside a running bulk forward, between two of its layers, on the
same thread; what no layer takes runs after the bulk call; the gate lets the inner forward in."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from worker.batching.forward_threads import ForwardGate
from worker.batching.preemption import Preemption, layer_stack


class Layer(nn.Module):
    """Logs who ran it under its index (a layer's number, or a block's name) and applies weights."""

    def __init__(self, index: int | str, log: list[tuple[str, int | str]], who: threading.local) -> None:
        super().__init__()
        self.index, self.log, self.who = index, log, who
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append((self.who.name, self.index))
        return self.linear(x)


class Encoder(nn.Module):
    """A BERT-like shape: the layers at ``encoder.layer``."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.log: list[tuple[str, int | str]] = []
        self.who = threading.local()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(Layer(i, self.log, self.who) for i in range(layers))

    def run(self, name: str) -> str:
        previous = getattr(self.who, "name", None)
        self.who.name = name
        try:
            with torch.inference_mode():
                x = torch.zeros(1, 4)
                for layer in self.encoder.layer:
                    x = layer(x)
            return name
        finally:
            self.who.name = previous


def pause_bulk_at(model: Encoder, index: int) -> tuple[threading.Event, threading.Event]:
    """A hook that stops the bulk call at layer ``index`` (after the preemption hook there) until
    told: (set when it stops there, set to let it go on)."""
    paused, go_on = threading.Event(), threading.Event()

    def pause(module: nn.Module, args: object) -> None:
        if model.who.name == "bulk":
            paused.set()
            assert go_on.wait(10)

    model.encoder.layer[index].register_forward_pre_hook(pause)
    return paused, go_on


@pytest.fixture
def forward_thread():
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True)


def test_the_layers_are_found_where_the_families_keep_them():
    assert len(layer_stack(Encoder(3))) == 3
    wrapper = nn.Module()
    wrapper.base_model = Encoder(2)
    assert len(layer_stack(wrapper)) == 2
    assert layer_stack(nn.Linear(2, 2)) == [] and layer_stack(None) == []
    weights_only = nn.Module()
    weights_only.layers = [object(), object()]  # a stack of plain records: nothing to hook
    assert layer_stack(weights_only) == []


def test_an_interactive_call_runs_inside_the_bulk_forward_at_the_next_layer(forward_thread):
    model = Encoder(4)
    counted: list[int] = []
    pre = Preemption(on_preempt=lambda: counted.append(1))
    assert pre.install(model) == 4
    paused, go_on = pause_bulk_at(model, 1)
    bulk = pre.bulk(forward_thread, lambda: model.run("bulk"))
    assert paused.wait(10) and pre.bulk_running
    urgent = pre.submit(forward_thread, lambda: model.run("interactive"))
    go_on.set()
    assert urgent.result(10) == "interactive" and bulk.result(10) == "bulk"
    assert model.log == [
        ("bulk", 0),
        ("bulk", 1),
        *(("interactive", i) for i in range(4)),  # at layer 2's hook, whole
        ("bulk", 2),
        ("bulk", 3),
    ]
    assert counted == [1] and not pre.bulk_running


class BlockLayer(nn.Module):
    """A layer that calls two blocks of weights (attention, feed-forward) and holds a list it never
    calls."""

    def __init__(self, index: int, log: list[tuple[str, int | str]], who: threading.local) -> None:
        super().__init__()
        self.attention = Layer(f"{index}.attention", log, who)
        self.feed_forward = Layer(f"{index}.feed_forward", log, who)
        self.unused = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.attention(x))


def test_an_interactive_call_runs_between_two_blocks_of_a_bulk_layer(forward_thread):
    model = Encoder(0)
    model.encoder.layer = nn.ModuleList(BlockLayer(i, model.log, model.who) for i in range(2))
    pre = Preemption()
    assert pre.install(model) == 2
    in_attention = threading.Event()
    go_on = threading.Event()

    def pause(module: nn.Module, args: object) -> None:  # the bulk call stops in layer 0's attention
        if model.who.name == "bulk":
            in_attention.set()
            assert go_on.wait(10)

    handle = model.encoder.layer[0].attention.linear.register_forward_pre_hook(pause)
    bulk = pre.bulk(forward_thread, lambda: model.run("bulk"))
    assert in_attention.wait(10)
    handle.remove()
    urgent = pre.submit(forward_thread, lambda: model.run("interactive"))
    go_on.set()
    assert urgent.result(10) == "interactive" and bulk.result(10) == "bulk"
    assert model.log == [
        ("bulk", "0.attention"),
        *(("interactive", f"{i}.{b}") for i in range(2) for b in ("attention", "feed_forward")),
        ("bulk", "0.feed_forward"),  # not at layer 1: inside layer 0, before its feed-forward
        ("bulk", "1.attention"),
        ("bulk", "1.feed_forward"),
    ]


def test_what_no_layer_takes_runs_after_the_bulk_call_once(forward_thread):
    counted: list[int] = []
    pre = Preemption(on_preempt=lambda: counted.append(1))
    release = threading.Event()
    ran: list[str] = []
    bulk = pre.bulk(forward_thread, lambda: (release.wait(10), ran.append("bulk")))
    urgent = pre.submit(forward_thread, lambda: ran.append("interactive") or "done")
    release.set()
    assert urgent.result(10) == "done" and bulk.result(10)
    pre.run_waiting()  # nothing left: it ran once
    assert ran == ["bulk", "interactive"] and counted == []


def test_no_preemption_while_forwards_share_state(forward_thread):
    model = Encoder(3)
    counted: list[int] = []
    pre = Preemption(allowed=lambda: False, on_preempt=lambda: counted.append(1))  # a LoRA active
    pre.install(model)
    started = threading.Event()
    go_on = threading.Event()

    def bulk_call() -> str:
        started.set()
        assert go_on.wait(10)
        return model.run("bulk")

    bulk = pre.bulk(forward_thread, bulk_call)
    assert started.wait(10)
    urgent = pre.submit(forward_thread, lambda: model.run("interactive"))
    go_on.set()
    assert bulk.result(10) == "bulk" and urgent.result(10) == "interactive"
    assert [who for who, _ in model.log] == ["bulk"] * 3 + ["interactive"] * 3 and counted == []


def test_a_bulk_call_cancelled_before_it_ran_is_not_counted_as_running(forward_thread):
    pre = Preemption()
    hold = threading.Event()
    first = forward_thread.submit(hold.wait, 10)  # the forward thread is busy
    queued = pre.bulk(forward_thread, lambda: "never")
    assert pre.bulk_running and queued.cancel()
    assert not pre.bulk_running
    hold.set()
    first.result(10)


def test_a_cancelled_interactive_call_is_skipped(forward_thread):
    pre = Preemption()
    release = threading.Event()
    ran: list[str] = []
    pre.bulk(forward_thread, lambda: release.wait(10))
    urgent = pre.submit(forward_thread, lambda: ran.append("interactive"))
    assert urgent.cancel()
    release.set()
    deadline = time.monotonic() + 10
    while pre.bulk_running and time.monotonic() < deadline:
        time.sleep(0.01)
    forward_thread.submit(lambda: None).result(10)  # past the queued run_waiting
    assert ran == []


def test_a_forward_inside_a_forward_takes_the_gate_without_waiting_for_a_state_change():
    """The inner forward's shared hold must not wait behind an exclusive holder that waits for the
    outer one: that would be a deadlock."""
    gate = ForwardGate()
    exclusive_waiting = threading.Event()
    order: list[str] = []

    def change() -> None:
        exclusive_waiting.set()
        with gate.exclusive():
            order.append("change")

    with gate.shared():
        changer = threading.Thread(target=change)
        changer.start()
        assert exclusive_waiting.wait(10)
        deadline = time.monotonic() + 10
        while not gate._exclusive_waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        with gate.shared():  # the inner forward
            order.append("inner")
        order.append("outer out")
    changer.join(10)
    assert order == ["inner", "outer out", "change"]


@pytest.mark.parametrize(("max_share", "second_inside"), [(0.5, False), (1.0, True)])
def test_interactive_work_takes_at_most_its_share_of_a_bulk_forward(forward_thread, max_share, second_inside):
    """The first interactive call runs inside at layer 1 and takes 50 ms while the bulk forward has
    run for almost none: with half the forward's time as the share, the second (arriving during
    the first) waits for the forward's end; with all of it, it runs at layer 2."""
    model = Encoder(4)
    pre = Preemption(max_share=max_share)
    pre.install(model)
    paused, go_on = pause_bulk_at(model, 0)
    second: list[object] = []

    def first_call() -> str:
        time.sleep(0.05)
        second.append(pre.submit(forward_thread, lambda: model.run("second")))
        return model.run("first")

    bulk = pre.bulk(forward_thread, lambda: model.run("bulk"))
    assert paused.wait(10)
    first = pre.submit(forward_thread, first_call)
    go_on.set()
    assert first.result(10) == "first" and bulk.result(10) == "bulk"
    assert second[0].result(10) == "second"  # type: ignore[attr-defined]
    bulk_done_at = max(i for i, (who, _) in enumerate(model.log) if who == "bulk")
    second_at = min(i for i, (who, _) in enumerate(model.log) if who == "second")
    assert (second_at < bulk_done_at) is second_inside


def test_after_interactive_work_a_bulk_forward_waits_at_its_next_block_for_more(forward_thread):
    """Inside the quiet window the bulk forward stops at its next layer until the client's next call
    comes, which then runs there; with no window it would have had to wait for the forward's end."""
    model = Encoder(4)
    pre = Preemption(max_share=1.0, quiet_s=60.0)
    pre.install(model)
    paused, go_on = pause_bulk_at(model, 1)
    bulk = pre.bulk(forward_thread, lambda: model.run("bulk"))
    assert paused.wait(10)
    first = pre.submit(forward_thread, lambda: model.run("first"))
    go_on.set()
    assert first.result(10) == "first"  # ran at layer 1's block; the bulk forward now waits at layer 2
    pre.quiet_s = 0.0  # the client's last call: no window after it, so the bulk forward ends at once
    second = pre.submit(forward_thread, lambda: model.run("second"))
    assert second.result(10) == "second" and bulk.result(10) == "bulk"
    assert model.log == [
        ("bulk", 0),
        ("bulk", 1),
        *(("first", i) for i in range(4)),
        *(("second", i) for i in range(4)),  # at layer 2's hook, where the bulk forward waited
        ("bulk", 2),
        ("bulk", 3),
    ]


def test_the_quiet_window_starts_after_interactive_work_outside_a_bulk_forward(forward_thread):
    """An interactive call that ran alone (LoadedModel's plain path ends with interactive_ended)
    makes the next bulk forward wait at its first layer for the next interactive call."""
    model = Encoder(3)
    pre = Preemption(max_share=1.0, quiet_s=60.0)
    pre.install(model)
    pre.interactive_ended()
    bulk = pre.bulk(forward_thread, lambda: model.run("bulk"))
    time.sleep(0.05)  # the bulk forward is at layer 0's hook, waiting
    assert model.log == []
    pre.quiet_s = 0.0  # the client's last call: no window after it
    second = pre.submit(forward_thread, lambda: model.run("second"))
    assert second.result(10) == "second" and bulk.result(10) == "bulk"
    assert model.log == [*(("second", i) for i in range(3)), *(("bulk", i) for i in range(3))]


def test_a_quiet_wait_beyond_the_bulk_forwards_share_is_not_taken(forward_thread):
    """With a share that a minute's wait would exceed, the bulk forward goes on at once: it ends
    without an interactive call coming, long before the window would have closed."""
    model = Encoder(3)
    pre = Preemption(max_share=0.5, quiet_s=60.0)
    pre.install(model)
    pre.interactive_ended()
    assert pre.bulk(forward_thread, lambda: model.run("bulk")).result(10) == "bulk"
    assert model.log == [("bulk", i) for i in range(3)]


class Threads:
    """Stands for torch's intra-op thread count, the whole process's (worker/models/loaded.py sets
    it only where it differs): each count set."""

    def __init__(self, n: int) -> None:
        self.now, self.set_to = n, []

    def __call__(self, n: int) -> None:
        if n != self.now:
            self.now = n
            self.set_to.append(n)


def test_while_interactive_work_comes_a_bulk_forward_spares_a_core_and_the_work_inside_has_them_all(
    forward_thread,
):
    model = Encoder(3)
    threads = Threads(4)
    pre = Preemption(max_share=1.0, threads=4, set_threads=threads, spare_core_s=60.0)
    pre.install(model)
    seen: dict[str, int] = {}

    def interactive() -> str:
        seen["interactive"] = threads.now
        return model.run("interactive")

    def bulk_call() -> str:
        seen["bulk"] = threads.now
        return model.run("bulk")

    pre.interactive_ended()  # a client's answer just went out
    paused, go_on = pause_bulk_at(model, 1)
    bulk = pre.bulk(forward_thread, bulk_call)
    assert paused.wait(10)
    urgent = pre.submit(forward_thread, interactive)
    go_on.set()
    assert urgent.result(10) == "interactive" and bulk.result(10) == "bulk"
    assert seen == {"bulk": 3, "interactive": 4}
    assert threads.set_to == [3, 4, 3, 4]  # bulk starts on 3, the work inside on 4, back, all at its end
    assert [who for who, _ in model.log] == ["bulk"] * 2 + ["interactive"] * 3 + ["bulk"]


def test_a_bulk_forward_takes_its_count_back_after_another_model_changed_it(forward_thread):
    """torch's count is the process's: another model's bulk forward ending in the middle of this one
    sets every thread back, and this one spares its core again at its next block."""
    model = Encoder(3)
    threads = Threads(2)
    pre = Preemption(max_share=1.0, threads=2, set_threads=threads, spare_core_s=60.0)
    pre.install(model)
    seen: list[int] = []
    model.encoder.layer[2].register_forward_pre_hook(lambda module, args: seen.append(threads.now))
    pre.interactive_ended()
    paused, go_on = pause_bulk_at(model, 1)
    bulk = pre.bulk(forward_thread, lambda: model.run("bulk"))
    assert paused.wait(10)
    threads(2)  # the other model's bulk forward ends: all threads
    go_on.set()
    assert bulk.result(10) == "bulk"
    assert seen == [1]  # layer 2 ran on one thread again
    assert threads.set_to == [1, 2, 1, 2]


@pytest.mark.parametrize("spare_core_s", [0.0, 60.0])
def test_a_bulk_forward_runs_on_every_thread_without_interactive_work_lately(forward_thread, spare_core_s):
    """No interactive work yet (or the window set to none): the bulk forward keeps all its threads."""
    threads = Threads(2)
    pre = Preemption(threads=2, set_threads=threads, spare_core_s=spare_core_s)
    if not spare_core_s:
        pre.interactive_ended()
    assert pre.bulk(forward_thread, lambda: threads.now).result(10) == 2
    assert threads.set_to == []


def test_one_thread_is_never_spared(forward_thread):
    threads = Threads(1)
    pre = Preemption(threads=1, set_threads=threads, spare_core_s=60.0)
    pre.interactive_ended()
    assert pre.bulk(forward_thread, lambda: threads.now).result(10) == 1
    assert threads.set_to == []
