"""The priority class of a request (protocol/priority.py): one rule for the gateway and ``sie serve``."""

from __future__ import annotations

import pytest

from protocol.errors import ErrorCode, SIEError
from protocol.priority import priority_setting, request_priority


@pytest.mark.parametrize(
    ("header", "token", "default", "expected"),
    [
        (None, None, "interactive", "interactive"),
        (None, None, "bulk", "bulk"),  # the pool's (or the gateway's) default
        (None, "bulk", "interactive", "bulk"),  # a bulk token wins over the default
        ("interactive", "bulk", "bulk", "interactive"),  # the header wins over both
        (" BULK ", None, "interactive", "bulk"),
        ("", None, "bulk", "bulk"),
    ],
)
def test_request_priority_precedence(header, token, default, expected):
    assert request_priority(header, token, default) == expected


def test_an_unknown_priority_is_a_400():
    with pytest.raises(SIEError) as err:
        request_priority("urgent", None, "interactive")
    assert err.value.code == ErrorCode.INVALID_INPUT and err.value.status == 400
    assert err.value.param == "X-SIE-Priority"


def test_a_default_priority_setting_is_checked_and_normalised():
    assert priority_setting(" Bulk ", "SIE_X") == "bulk"
    with pytest.raises(ValueError, match="SIE_X"):
        priority_setting("urgent", "SIE_X")
