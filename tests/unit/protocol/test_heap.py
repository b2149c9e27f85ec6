"""protocol.heap: a process freezes what start-up built, collecting its garbage first."""

from __future__ import annotations

import gc
import weakref

from protocol import heap


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def _in_generations(objs: list) -> list[bool]:
    tracked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
    return [id(o) in tracked for o in objs]


def test_freeze_moves_live_objects_out_of_the_generations_until_unfreeze() -> None:
    kept = [[i] for i in range(5)]  # lists are tracked by the collector
    heap.freeze()
    try:
        assert gc.get_freeze_count() >= len(kept)
        assert _in_generations(kept) == [False] * len(kept)
    finally:
        heap.unfreeze()
    assert gc.get_freeze_count() == 0
    assert _in_generations(kept) == [True] * len(kept)


def test_freeze_collects_cyclic_garbage_before_freezing() -> None:
    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    heap.freeze()
    try:
        assert gone() is None  # frozen without that collection, the cycle would live on
    finally:
        heap.unfreeze()
