"""The config-delta epoch rule (protocol/config_delta.py) that the gateway and the sidecar share."""

from __future__ import annotations

import pytest

from protocol.config_delta import EpochOrder, epoch_bump_is_news, epoch_order


@pytest.mark.parametrize(
    ("delta", "applied", "expected"),
    [
        (4, 5, EpochOrder.STALE),
        (5, 5, EpochOrder.DUPLICATE),
        (6, 5, EpochOrder.NEXT),
        (8, 5, EpochOrder.GAP),
        (1, 0, EpochOrder.NEXT),
        (3, 0, EpochOrder.GAP),
        (0, 0, EpochOrder.NEXT),  # unversioned: a config service without a store stays at epoch 0
        (0, 2, EpochOrder.STALE),
    ],
)
def test_epoch_order(delta, applied, expected):
    assert epoch_order(delta, applied) is expected


def test_an_epoch_bump_matters_only_when_ahead():
    assert epoch_bump_is_news(6, 5)
    assert not epoch_bump_is_news(5, 5)
    assert not epoch_bump_is_news(4, 5)
