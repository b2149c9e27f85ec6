"""protocol.ipc.forward_share: how much of a queue the next batch takes while forward threads are idle."""

from __future__ import annotations

import pytest

from protocol.ipc import forward_share


@pytest.mark.parametrize(
    ("pending", "idle", "most", "share"),
    [
        (32, 2, 64, 16),  # a lone request of 32 on two idle threads: two forwards of 16
        (33, 2, 64, 17),  # rounded up: the second thread takes the 16 left
        (1, 2, 64, 1),  # never less than one item
        (32, 4, 64, 8),
        (200, 2, 64, 64),  # never more than a batch holds
        (32, 1, 64, 64),  # one idle thread (or none): the whole batch size
        (32, 0, 64, 64),
    ],
)
def test_an_equal_share_for_each_idle_forward_thread(pending: int, idle: int, most: int, share: int) -> None:
    assert forward_share(pending, idle, most) == share
