"""The retry matrix (which error answers the client retries, and after how long), written once for the sync and the async client.

Everything here is pure: the clients describe what one attempt produced (an ``Answer``),
``classify`` names the matrix row, and ``decide`` says whether to try again and after how
long. The clients only send, sleep and raise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum

DEFAULT_PROVISION_TIMEOUT_S = 900.0
PROVISIONING_DEFAULT_DELAY_S = 5.0
MODEL_LOADING_DEFAULT_DELAY_S = 5.0
LORA_LOADING_DEFAULT_DELAY_S = 1.0
LORA_LOADING_MAX_RETRIES = 10
RESOURCE_EXHAUSTED_MAX_RETRIES = 3
RESOURCE_EXHAUSTED_DEFAULT_DELAY_S = 5.0
RESOURCE_EXHAUSTED_MAX_DELAY_S = 30.0
RATE_LIMIT_DEFAULT_DELAY_S = 1.0
QUEUE_DEFAULT_DELAY_S = 1.0
GATEWAY_TIMEOUT_DEFAULT_DELAY_S = 5.0
TRANSPORT_DEFAULT_DELAY_S = 5.0
# A server this client has never reached (refused, name not found, connect timeout): a few quick
# retries ride out a restart, then the call fails naming the URL, instead of spending the budget.
UNREACHABLE_DELAYS_S = (0.5, 1.0, 2.0)
# A call that has waited longer than this logs every further retry at WARNING (else DEBUG).
VISIBLE_WAIT_S = 3.0
JITTER_FRACTION = 0.25

_QUEUE_CODES = frozenset({"QUEUE_FULL", "BILLING_CAPACITY_UNAVAILABLE"})
_QUEUE_CODES_WITH_HINT = frozenset({"QUEUE_UNAVAILABLE", "transport_failure"})


class Transport(Enum):
    """How an attempt failed before an HTTP answer came back."""

    UNREACHED = "unreached"  # no connection: refused, name not resolved, connect timeout
    RETRYABLE = "retryable"  # reset, pool/write timeout, peer closed mid-answer
    FATAL = "fatal"  # read timeout (the request may have run), TLS, invalid URL


class Rule(Enum):
    """One row of the retry matrix."""

    OK = "ok"
    MODEL_LOAD_FAILED = "model_load_failed"
    INPUT_TOO_LONG = "input_too_long"
    PROVISIONING = "provisioning"
    LORA_LOADING = "lora_loading"
    MODEL_LOADING = "model_loading"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    RATE_LIMITED = "rate_limited"
    QUEUE = "queue"
    GATEWAY_TIMEOUT = "gateway_timeout"
    CLIENT_ERROR = "client_error"  # other 3xx/4xx
    SERVER_ERROR = "server_error"  # other 5xx
    UNREACHABLE = "unreachable"  # no connection could be made
    TRANSPORT = "transport"
    TRANSPORT_FATAL = "transport_fatal"


# What a retry of each row waits for, in the log line that announces it.
WAITING_FOR = {
    Rule.PROVISIONING: "capacity (the cluster is provisioning a worker)",
    Rule.LORA_LOADING: "the LoRA adapter to load",
    Rule.MODEL_LOADING: "the model to load",
    Rule.RESOURCE_EXHAUSTED: "memory on the worker",
    Rule.RATE_LIMITED: "the rate limit",
    Rule.QUEUE: "room in the work queue",
    Rule.GATEWAY_TIMEOUT: "the gateway (it timed out waiting for a worker)",
    Rule.UNREACHABLE: "the server to accept connections",
    Rule.TRANSPORT: "the server to answer again (the connection failed)",
}


@dataclass(frozen=True)
class Answer:
    """What one attempt produced: an HTTP status with its error code, or a transport failure."""

    status: int | None = None
    code: str | None = None  # X-SIE-Error-Code if set, else the body code
    body_code: str | None = None  # the code in the error body alone
    retry_after: float | None = None
    transport: Transport | None = None


def classify(answer: Answer, *, operation: str = "encode") -> Rule:
    """Name the matrix row for ``answer``; rows are checked in the contract's order."""
    if answer.transport is not None:
        return {
            Transport.UNREACHED: Rule.UNREACHABLE,
            Transport.RETRYABLE: Rule.TRANSPORT,
            Transport.FATAL: Rule.TRANSPORT_FATAL,
        }[answer.transport]
    status = answer.status or 0
    code = answer.code
    codes = {answer.code, answer.body_code}
    if status == 202:  # scale-from-zero answer to clients that do not announce SDK 0.7+
        return Rule.PROVISIONING
    if 200 <= status < 300:
        return Rule.OK
    if status == 502 and "MODEL_LOAD_FAILED" in codes:
        return Rule.MODEL_LOAD_FAILED
    if status == 400 and "INPUT_TOO_LONG" in codes:
        return Rule.INPUT_TOO_LONG
    if status == 503:
        if code == "PROVISIONING":
            return Rule.PROVISIONING
        if code == "LORA_LOADING" and operation == "encode":
            return Rule.LORA_LOADING
        if code == "MODEL_LOADING":
            return Rule.MODEL_LOADING
        if code == "RESOURCE_EXHAUSTED":
            return Rule.RESOURCE_EXHAUSTED
        if code in _QUEUE_CODES or (code in _QUEUE_CODES_WITH_HINT and answer.retry_after is not None):
            return Rule.QUEUE
    if status == 429:
        return Rule.RATE_LIMITED
    if status == 504:
        return Rule.GATEWAY_TIMEOUT
    if status >= 500:
        return Rule.SERVER_ERROR
    return Rule.CLIENT_ERROR


@dataclass
class RetryState:
    """Per-call bookkeeping; ``deadline`` is on the clock the caller passes as ``now``.

    ``server_seen``: an HTTP answer has come from this server (in this call, or earlier to the
    same client). Only then is a refused connection a server restarting, worth the budget.
    """

    deadline: float
    budget_s: float = DEFAULT_PROVISION_TIMEOUT_S
    wait_for_capacity: bool = True
    max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES
    server_seen: bool = False
    retries: int = 0
    lora_retries: int = 0
    oom_retries: int = 0
    unreached_retries: int = 0
    waited_s: float = 0.0  # the sum of the delays decided so far
    rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def start(
        cls,
        now: float,
        *,
        provision_timeout_s: float | None,
        wait_for_capacity: bool,
        max_oom_retries: int,
        server_seen: bool = False,
        rng: random.Random | None = None,
    ) -> RetryState:
        budget = DEFAULT_PROVISION_TIMEOUT_S if provision_timeout_s is None else float(provision_timeout_s)
        return cls(
            deadline=now + budget,
            budget_s=budget,
            wait_for_capacity=wait_for_capacity,
            max_oom_retries=max(0, int(max_oom_retries)),
            server_seen=server_seen,
            rng=rng or random.Random(),
        )

    def remaining(self, now: float) -> float:
        return self.deadline - now


@dataclass(frozen=True)
class Decision:
    rule: Rule
    retry: bool
    delay: float = 0.0


# The rows retried within the call's budget after the server's Retry-After, else after their own
# default delay (jittered): that delay, and whether only a caller that waits for capacity retries.
# A transport failure has no Retry-After; it waits the default.
_PATIENT: dict[Rule, tuple[float, bool]] = {
    Rule.PROVISIONING: (PROVISIONING_DEFAULT_DELAY_S, True),
    Rule.MODEL_LOADING: (MODEL_LOADING_DEFAULT_DELAY_S, False),
    Rule.RATE_LIMITED: (RATE_LIMIT_DEFAULT_DELAY_S, False),
    Rule.QUEUE: (QUEUE_DEFAULT_DELAY_S, False),
    Rule.GATEWAY_TIMEOUT: (GATEWAY_TIMEOUT_DEFAULT_DELAY_S, True),
    Rule.TRANSPORT: (TRANSPORT_DEFAULT_DELAY_S, True),
}


def _jitter(delay: float, rng: random.Random) -> float:
    """Downward jitter on the SDK's own default delays (never longer than the default)."""
    return delay * (1.0 - JITTER_FRACTION * rng.random())


def _hint_or(answer: Answer, default: float, rng: random.Random) -> float:
    return answer.retry_after if answer.retry_after is not None else _jitter(default, rng)


def _within_budget(rule: Rule, delay: float, state: RetryState, now: float) -> Decision:
    remaining = state.remaining(now)
    if remaining <= 0:
        return Decision(rule, retry=False)
    # The sleep is capped by what is left; the attempt after it is the final one.
    return Decision(rule, retry=True, delay=max(0.0, min(delay, remaining)))


def decide(answer: Answer, state: RetryState, now: float, *, operation: str = "encode") -> Decision:
    """Decide what to do with ``answer``; updates the counters in ``state`` when it retries."""
    rule = classify(answer, operation=operation)
    rng = state.rng
    waiting = state.wait_for_capacity
    if answer.status is not None:
        state.server_seen = True
    if rule is Rule.UNREACHABLE and state.server_seen:
        rule = Rule.TRANSPORT  # the server answered before: a restart, worth the budget

    if rule in _PATIENT:
        default, only_when_waiting = _PATIENT[rule]
        decision = (
            Decision(rule, retry=False)
            if only_when_waiting and not waiting
            else _within_budget(rule, _hint_or(answer, default, rng), state, now)
        )
    elif rule is Rule.LORA_LOADING:
        if state.lora_retries >= LORA_LOADING_MAX_RETRIES:
            decision = Decision(rule, retry=False)
        else:
            delay = answer.retry_after if answer.retry_after is not None else LORA_LOADING_DEFAULT_DELAY_S
            decision = _within_budget(rule, delay, state, now)
            if decision.retry:
                state.lora_retries += 1
    elif rule is Rule.RESOURCE_EXHAUSTED:
        decision = _oom(answer, state, now)
    elif rule is Rule.UNREACHABLE:
        n = state.unreached_retries
        if waiting and n < len(UNREACHABLE_DELAYS_S):
            decision = _within_budget(rule, UNREACHABLE_DELAYS_S[n], state, now)
            if decision.retry:
                state.unreached_retries += 1
        else:
            decision = Decision(rule, retry=False)
    else:  # OK and every terminal row
        decision = Decision(rule, retry=False)

    if decision.retry:
        state.retries += 1
        state.waited_s += decision.delay
    return decision


def retry_note(decision: Decision, state: RetryState, now: float, *, what: str) -> tuple[bool, str]:
    """(loud, line) announcing a retry of the call ``what`` (e.g. ``encode org/model``): loud (a
    warning) once the call's waits, this one included, add up to VISIBLE_WAIT_S; the line says what
    it waits for, how long it sleeps and how much of the budget is left."""
    loud = state.waited_s >= VISIBLE_WAIT_S
    waiting_for = WAITING_FOR.get(decision.rule, decision.rule.value)
    if decision.rule is Rule.UNREACHABLE:
        left = f"{len(UNREACHABLE_DELAYS_S) - state.unreached_retries} quick retries left after it"
    else:
        left = f"{max(0.0, state.remaining(now) - decision.delay):.0f} s of the {state.budget_s:.0f} s budget left after it"
    return loud, (
        f"{what}: waiting for {waiting_for}; retry {state.retries} in {decision.delay:.1f} s "
        f"(waited {state.waited_s - decision.delay:.1f} s so far; {left})"
    )


def _oom(answer: Answer, state: RetryState, now: float) -> Decision:
    rule = Rule.RESOURCE_EXHAUSTED
    n = state.oom_retries
    if n >= state.max_oom_retries:
        return Decision(rule, retry=False)
    if answer.retry_after is not None:
        base = min(answer.retry_after, RESOURCE_EXHAUSTED_MAX_DELAY_S)
        delay = min(base * (2**n), RESOURCE_EXHAUSTED_MAX_DELAY_S)
        if n > 0:
            delay = _jitter(delay, state.rng)
    else:
        delay = _jitter(
            min(RESOURCE_EXHAUSTED_DEFAULT_DELAY_S * (2**n), RESOURCE_EXHAUSTED_MAX_DELAY_S), state.rng
        )
    if delay >= state.remaining(now):
        return Decision(rule, retry=False)  # the sleep would eat the whole budget: give up now
    state.oom_retries += 1
    return Decision(rule, retry=True, delay=delay)


def attempt_timeout(read_timeout_s: float, state: RetryState, now: float) -> float:
    """Read timeout of one attempt: capped by the budget left, uncapped for the final attempt."""
    remaining = state.remaining(now)
    return min(read_timeout_s, remaining) if remaining > 0 else read_timeout_s
