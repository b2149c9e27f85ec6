"""Forward threads: how intra-op threads are shared, and the gate that keeps state changes apart from
forwards."""

from __future__ import annotations

import threading

from worker.batching.forward_threads import ForwardGate, thread_plan


def test_thread_plan_shares_the_threads_on_cpu_and_keeps_one_on_cuda():
    assert thread_plan(on_cuda=False, forward_threads=1, torch_threads=2) == (1, 2)
    assert thread_plan(on_cuda=False, forward_threads=2, torch_threads=2) == (2, 1)
    assert thread_plan(on_cuda=False, forward_threads=2, torch_threads=8) == (2, 4)
    assert thread_plan(on_cuda=False, forward_threads=4, torch_threads=2) == (4, 1)  # never below one thread
    assert thread_plan(on_cuda=True, forward_threads=4, torch_threads=8) == (1, 8)


def test_forwards_hold_the_gate_together():
    gate = ForwardGate()
    both_in = threading.Barrier(2, timeout=10)  # broken (and the test failed) unless both are inside at once
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            with gate.shared():
                both_in.wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=forward) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors


def test_a_state_change_waits_for_running_forwards_and_keeps_new_ones_out():
    gate = ForwardGate()
    order: list[str] = []
    running = threading.Event()
    release = threading.Event()

    def forward(name: str, hold: bool) -> None:
        with gate.shared():
            order.append(f"{name} in")
            if hold:
                running.set()
                release.wait(10)
            order.append(f"{name} out")

    def change() -> None:
        with gate.exclusive():
            order.append("change")

    first = threading.Thread(target=forward, args=("first", True))
    first.start()
    assert running.wait(10)
    changer = threading.Thread(target=change)
    changer.start()
    while not gate._exclusive_waiting:  # the change is waiting for the running forward
        threading.Event().wait(0.005)
    later = threading.Thread(target=forward, args=("later", False))
    later.start()
    threading.Event().wait(0.1)
    assert order == ["first in"]  # neither the change nor the later forward got in meanwhile
    release.set()
    for t in (first, changer, later):
        t.join(10)
    assert order == ["first in", "first out", "change", "later in", "later out"]


def test_the_setting_keeps_its_former_name_as_an_alias(monkeypatch):
    from worker.settings import WorkerSettings

    monkeypatch.delenv("SIE_FORWARD_THREADS", raising=False)
    monkeypatch.setenv("SIE_FORWARD_LANES", "2")
    assert WorkerSettings().forward_threads == 2
    monkeypatch.setenv("SIE_FORWARD_THREADS", "3")  # the new name wins
    assert WorkerSettings().forward_threads == 3
    assert WorkerSettings(forward_threads=4).forward_threads == 4
