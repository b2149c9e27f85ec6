"""The pure retry policy and header parsing (no network)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from sdk._retry import (
    UNREACHABLE_DELAYS_S,
    VISIBLE_WAIT_S,
    Answer,
    RetryState,
    Rule,
    Transport,
    attempt_timeout,
    classify,
    decide,
    retry_note,
)
from sdk._wire import parse_retry_after, routing_headers


def state(**kw) -> RetryState:
    kw.setdefault("provision_timeout_s", 100.0)
    kw.setdefault("wait_for_capacity", True)
    kw.setdefault("max_oom_retries", 3)
    return RetryState.start(0.0, rng=random.Random(1), **kw)


@pytest.mark.parametrize(
    ("answer", "rule"),
    [
        (Answer(status=200), Rule.OK),
        (Answer(status=202), Rule.PROVISIONING),
        (Answer(status=502, code="X", body_code="MODEL_LOAD_FAILED"), Rule.MODEL_LOAD_FAILED),
        (Answer(status=502), Rule.SERVER_ERROR),
        (Answer(status=400, code="INPUT_TOO_LONG"), Rule.INPUT_TOO_LONG),
        (Answer(status=413, code="INPUT_TOO_LONG"), Rule.CLIENT_ERROR),
        (Answer(status=503, code="LORA_LOADING"), Rule.LORA_LOADING),
        (Answer(status=503, code="QUEUE_UNAVAILABLE"), Rule.SERVER_ERROR),
        (Answer(status=503, code="QUEUE_UNAVAILABLE", retry_after=1), Rule.QUEUE),
        (Answer(status=503, code="BILLING_CAPACITY_UNAVAILABLE"), Rule.QUEUE),
        (Answer(status=429, code="ANY"), Rule.RATE_LIMITED),
        (Answer(status=504), Rule.GATEWAY_TIMEOUT),
        (Answer(status=301), Rule.CLIENT_ERROR),
        (Answer(transport=Transport.UNREACHED), Rule.UNREACHABLE),
        (Answer(transport=Transport.RETRYABLE), Rule.TRANSPORT),
        (Answer(transport=Transport.FATAL), Rule.TRANSPORT_FATAL),
    ],
)
def test_classify(answer, rule):
    assert classify(answer) is rule


def test_lora_loading_is_only_an_encode_row():
    assert classify(Answer(status=503, code="LORA_LOADING"), operation="score") is Rule.SERVER_ERROR


def test_default_delays_are_jittered_downward_and_retry_after_is_exact():
    s = state()
    delays = [decide(Answer(status=503, code="MODEL_LOADING"), s, 0.0).delay for _ in range(50)]
    assert all(3.75 <= d <= 5.0 for d in delays) and len(set(delays)) > 1
    assert decide(Answer(status=503, code="MODEL_LOADING", retry_after=2.5), s, 0.0).delay == 2.5


def test_delay_is_capped_by_the_budget_and_the_final_attempt_is_allowed():
    s = state(provision_timeout_s=3.0)
    d = decide(Answer(status=503, code="PROVISIONING", retry_after=120), s, 1.0)
    assert d.retry and d.delay == 2.0
    assert not decide(Answer(status=503, code="PROVISIONING", retry_after=120), s, 3.0).retry
    assert attempt_timeout(150.0, s, 1.0) == 2.0
    assert attempt_timeout(150.0, s, 5.0) == 150.0  # the final attempt keeps the client's timeout


def test_oom_backoff_doubles_and_is_capped():
    s = state(max_oom_retries=5, provision_timeout_s=1000)
    ans = Answer(status=503, code="RESOURCE_EXHAUSTED", retry_after=4)
    delays = [decide(ans, s, 0.0).delay for _ in range(5)]
    assert delays[0] == 4
    assert 6 <= delays[1] <= 8 and 12 <= delays[2] <= 16 and 22.5 <= delays[3] <= 30
    assert not decide(ans, s, 0.0).retry  # max_oom_retries reached
    assert s.oom_retries == 5


def test_oom_gives_up_when_the_sleep_would_eat_the_budget():
    s = state(provision_timeout_s=3.0)
    assert not decide(Answer(status=503, code="RESOURCE_EXHAUSTED", retry_after=5), s, 0.0).retry


def test_waiting_rows_fail_at_once_without_wait_for_capacity():
    s = state(wait_for_capacity=False)
    for answer in (
        Answer(status=503, code="PROVISIONING"),
        Answer(status=504),
        Answer(transport=Transport.RETRYABLE),
        Answer(transport=Transport.UNREACHED),
    ):
        assert not decide(answer, s, 0.0).retry
    assert decide(Answer(status=503, code="MODEL_LOADING"), s, 0.0).retry
    assert decide(Answer(status=429), s, 0.0).retry


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("3", 3.0),
        ("0.25", 0.25),
        ("0", 0.0),
        ("-1", None),
        ("nan", None),
        ("inf", None),
        ("soon", None),
        (None, None),
    ],
)
def test_parse_retry_after(value, expected):
    assert parse_retry_after(value) == expected


def test_parse_retry_after_http_date():
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 <= parse_retry_after(when) <= 31
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(past) == 0.0


def test_routing_headers():
    assert routing_headers(None) == {}
    assert routing_headers("l4") == {"X-SIE-MACHINE-PROFILE": "l4"}
    assert routing_headers("eval/l4") == {"X-SIE-Pool": "eval", "X-SIE-MACHINE-PROFILE": "l4"}


def test_version_skew_warning():
    from sdk._wire import version_skew

    assert version_skew("0.10.3") is None
    assert version_skew("0.11.0") is None
    assert version_skew(None) is None
    assert "more than one minor" in version_skew("0.12.0")
    assert version_skew("1.10.1") is not None


def test_importing_the_sdk_pulls_no_server_or_model_code():
    import subprocess
    import sys

    code = (
        "import sys, sdk, sdk.client, sdk.async_client, sdk.pools\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'transformers', 'worker', 'gateway', 'sidecar', 'config_service', 'nats', 'sqlalchemy'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --------------------------------------------------------------------------- a server that never answered


def test_a_server_never_reached_gets_a_few_quick_retries_not_the_budget():
    s = state(provision_timeout_s=900.0)
    unreached = Answer(transport=Transport.UNREACHED)
    delays = []
    while (d := decide(unreached, s, now=sum(delays))).retry:
        delays.append(d.delay)
    assert d.rule is Rule.UNREACHABLE
    assert tuple(delays) == UNREACHABLE_DELAYS_S and sum(delays) < 10  # seconds, not the 900 s budget
    assert s.retries == s.unreached_retries == len(UNREACHABLE_DELAYS_S)
    assert s.waited_s == sum(UNREACHABLE_DELAYS_S)


def test_quick_retries_are_capped_by_a_smaller_budget():
    s = state(provision_timeout_s=0.3)
    d = decide(Answer(transport=Transport.UNREACHED), s, 0.0)
    assert d.retry and d.delay == 0.3
    assert not decide(Answer(transport=Transport.UNREACHED), s, 0.3).retry


@pytest.mark.parametrize("seen_by", ["an earlier call", "this call"])
def test_a_refused_connection_after_the_server_answered_is_a_restart_worth_the_budget(seen_by):
    s = state(provision_timeout_s=900.0, server_seen=seen_by == "an earlier call")
    if seen_by == "this call":
        assert decide(Answer(status=503, code="PROVISIONING", retry_after=1), s, 0.0).retry
    now = 1.0
    for _ in range(10):  # far more than the quick retries: the budget bounds it
        d = decide(Answer(transport=Transport.UNREACHED), s, now)
        assert d.retry and d.rule is Rule.TRANSPORT and 3.75 <= d.delay <= 5.0
        now += d.delay
    assert s.unreached_retries == 0
    assert not decide(Answer(transport=Transport.UNREACHED), s, 901.0).retry


def test_retry_notes_turn_loud_once_the_call_has_waited_a_few_seconds():
    s = state(provision_timeout_s=900.0)
    notes = []
    now = 0.0
    while (d := decide(Answer(transport=Transport.UNREACHED), s, now)).retry:
        notes.append(retry_note(d, s, now, what="encode m at http://h:1"))
        now += d.delay
    waited = 0.0
    for (loud, line), delay in zip(notes, UNREACHABLE_DELAYS_S, strict=True):
        waited += delay
        assert loud is (waited >= VISIBLE_WAIT_S)
        assert line.startswith("encode m at http://h:1: waiting for the server to accept connections")
    assert [loud for loud, _ in notes][-1] is True  # the last quick retry is seen without any logging setup
    assert "0 quick retries left after it" in notes[-1][1] and "2 quick retries left" in notes[0][1]


def test_a_provisioning_wait_is_loud_at_once_and_says_what_it_waits_for_and_what_is_left():
    s = state(provision_timeout_s=900.0)
    d = decide(Answer(status=503, code="PROVISIONING", retry_after=5), s, 100.0)
    loud, line = retry_note(d, s, 100.0, what="encode m (HTTP 503 PROVISIONING)")
    assert loud
    assert line == (
        "encode m (HTTP 503 PROVISIONING): waiting for capacity (the cluster is provisioning a worker); "
        "retry 1 in 5.0 s (waited 0.0 s so far; 795 s of the 900 s budget left after it)"
    )
    short = state(provision_timeout_s=900.0)
    d = decide(Answer(status=503, code="MODEL_LOADING", retry_after=1), short, 0.0)
    assert retry_note(d, short, 0.0, what="encode m")[0] is False  # a 1 s wait stays quiet
