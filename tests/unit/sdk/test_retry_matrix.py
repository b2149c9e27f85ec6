"""Every row of the retry matrix, driven against a real loopback aiohttp server,
for the sync and the async client alike."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest

from sdk import (
    IncompleteBatchError,
    InputTooLongError,
    LoraLoadingError,
    ModelLoadFailedError,
    ModelLoadingError,
    ProvisioningError,
    RateLimitError,
    RequestError,
    ResourceExhaustedError,
    ServerError,
    SIEConnectionError,
)
from sdk._retry import UNREACHABLE_DELAYS_S
from tests.unit.sdk.conftest import FakeServer, Reply, err

MODEL = "org/model-a"
ITEM = {"text": "hello"}
FAST = "0.01"


def encode_calls(server):
    return server.calls("/v1/encode/", "POST")


# --------------------------------------------------------------------------- provisioning


def test_202_accepted_is_retried_until_capacity(server, make_client):
    server.script(
        "encode",
        Reply(
            status=202, json={"status": "provisioning", "message": "warming"}, headers={"Retry-After": FAST}
        ),
    )
    client = make_client()
    result = client.encode(MODEL, ITEM, provision_timeout_s=5)
    assert result["dense"].tolist() == [5.0, 0.0, 1.0, 2.0]
    assert len(encode_calls(server)) == 2
    assert client.last_retry_count == 1


def test_503_provisioning_is_retried_until_capacity(server, make_client):
    server.script(
        "encode",
        err("PROVISIONING", retry_after=FAST),
        err("PROVISIONING", retry_after=FAST, header_only=True),
    )
    client = make_client()
    result = client.encode(MODEL, ITEM, gpu="l4", provision_timeout_s=5)
    assert result["model"] == MODEL
    assert len(encode_calls(server)) == 3
    assert client.last_retry_count == 2


@pytest.mark.parametrize(
    "reply",
    [
        err("PROVISIONING", retry_after="7"),
        Reply(status=202, json={"status": "provisioning"}, headers={"Retry-After": "7"}),
    ],
    ids=["503", "202"],
)
def test_provisioning_without_waiting_raises_at_once(server, make_client, reply):
    server.script("encode", reply, repeat=True)
    client = make_client()
    with pytest.raises(ProvisioningError) as info:
        client.encode(MODEL, ITEM, gpu="l4", wait_for_capacity=False)
    assert info.value.retry_after == 7.0
    assert info.value.gpu == "l4"
    assert info.value.code == "PROVISIONING"
    assert len(encode_calls(server)) == 1


def test_provisioning_gives_up_when_the_budget_is_spent(server, make_client):
    server.script("encode", err("PROVISIONING", retry_after="0.2"), repeat=True)
    client = make_client()
    with pytest.raises(ProvisioningError) as info:
        client.encode(MODEL, ITEM, provision_timeout_s=0.7)
    calls = len(encode_calls(server))
    assert 3 <= calls <= 6  # waits of 0.2 s within 0.7 s, plus the final attempt
    assert info.value.status_code == 503


def test_lowercase_provisioning_code_in_body_is_understood(server, make_client):
    server.script("encode", Reply(status=503, json={"detail": {"code": "provisioning", "message": "x"}}))
    client = make_client()
    with pytest.raises(ProvisioningError):
        client.encode(MODEL, ITEM, wait_for_capacity=False)


# --------------------------------------------------------------------------- loading


def test_model_loading_is_retried_even_without_waiting_for_capacity(server, make_client):
    server.script("encode", err("MODEL_LOADING", retry_after=FAST), err("MODEL_LOADING", retry_after=FAST))
    client = make_client()
    result = client.encode(MODEL, ITEM, wait_for_capacity=False, provision_timeout_s=5)
    assert result["dense"].shape == (4,)
    assert client.last_retry_count == 2


def test_model_loading_ends_in_model_loading_error(server, make_client):
    server.script("encode", err("MODEL_LOADING", retry_after="0.1"), repeat=True)
    client = make_client()
    with pytest.raises(ModelLoadingError) as info:
        client.encode(MODEL, ITEM, provision_timeout_s=0.5)
    assert info.value.model == MODEL
    assert info.value.status_code == 503
    # retried until the budget ran out (how many times depends on the machine's speed, not asserted)
    assert client.last_retry_count >= 1 and len(encode_calls(server)) == client.last_retry_count + 1


def test_lora_loading_is_bounded_to_ten_retries(server, make_client):
    server.script("encode", err("LORA_LOADING", retry_after="0"), repeat=True)
    client = make_client()
    with pytest.raises(LoraLoadingError) as info:
        client.encode(MODEL, ITEM, options={"lora_id": "my-lora"}, provision_timeout_s=30)
    assert len(encode_calls(server)) == 11
    assert info.value.lora == "my-lora"


def test_model_load_failed_is_never_retried(server, make_client):
    server.script(
        "encode",
        err("MODEL_LOAD_FAILED", status=502, error_class="GATED", permanent=False, attempts=3),
        repeat=True,
    )
    client = make_client()
    with pytest.raises(ModelLoadFailedError) as info:
        client.encode(MODEL, ITEM)
    e = info.value
    assert (e.status_code, e.code, e.error_class, e.permanent, e.attempts) == (
        502,
        "MODEL_LOAD_FAILED",
        "GATED",
        False,
        3,
    )
    assert isinstance(e, ServerError)
    assert "model_load_failed from test server" in str(e)
    assert len(encode_calls(server)) == 1


# --------------------------------------------------------------------------- out of memory


def test_resource_exhausted_retries_then_succeeds(server, make_client):
    server.script(
        "encode", err("RESOURCE_EXHAUSTED", retry_after=FAST), err("RESOURCE_EXHAUSTED", retry_after=FAST)
    )
    client = make_client()
    assert client.encode(MODEL, ITEM, provision_timeout_s=5)["dense"].shape == (4,)
    assert client.last_retry_count == 2


def test_resource_exhausted_is_bounded_by_max_oom_retries(server, make_client):
    server.script("encode", err("RESOURCE_EXHAUSTED", retry_after=FAST), repeat=True)
    client = make_client()
    with pytest.raises(ResourceExhaustedError) as info:
        client.encode(MODEL, ITEM, max_oom_retries=2, provision_timeout_s=5)
    assert info.value.retries == 2
    assert len(encode_calls(server)) == 3


def test_resource_exhausted_with_zero_retries_fails_on_first_answer(server, make_client):
    server.script("encode", err("RESOURCE_EXHAUSTED", retry_after=FAST), repeat=True)
    client = make_client()
    with pytest.raises(ResourceExhaustedError) as info:
        client.encode(MODEL, ITEM, max_oom_retries=0)
    assert (info.value.status_code, info.value.code) == (503, "RESOURCE_EXHAUSTED")
    assert len(encode_calls(server)) == 1


# --------------------------------------------------------------------------- backpressure


def test_429_is_retried_without_waiting_for_capacity(server, make_client):
    server.script(
        "encode",
        Reply(
            status=429,
            json={"error": {"code": "RATE_LIMIT", "message": "slow down"}},
            headers={"Retry-After": FAST},
        ),
    )
    client = make_client()
    assert client.encode(MODEL, ITEM, wait_for_capacity=False)["model"] == MODEL
    assert len(encode_calls(server)) == 2


def test_429_ends_in_rate_limit_error_when_the_budget_is_spent(server, make_client):
    server.script(
        "encode",
        Reply(
            status=429,
            json={"error": {"code": "RATE_LIMIT", "message": "slow down"}},
            headers={"Retry-After": "0.1"},
        ),
        repeat=True,
    )
    client = make_client()
    with pytest.raises(RateLimitError) as info:
        client.encode(MODEL, ITEM, provision_timeout_s=0.4)
    assert (info.value.status_code, info.value.code, info.value.message) == (429, "RATE_LIMIT", "slow down")
    assert isinstance(info.value, RequestError)
    assert len(encode_calls(server)) >= 3


def test_queue_full_is_retried(server, make_client):
    server.script("encode", err("QUEUE_FULL", retry_after=FAST), err("QUEUE_FULL", retry_after=FAST))
    client = make_client()
    assert client.encode(MODEL, ITEM, wait_for_capacity=False)["model"] == MODEL
    assert len(encode_calls(server)) == 3


def test_queue_full_ends_in_server_error_with_its_code(server, make_client):
    server.script("encode", err("QUEUE_FULL", retry_after="0.1"), repeat=True)
    client = make_client()
    with pytest.raises(ServerError) as info:
        client.encode(MODEL, ITEM, provision_timeout_s=0.3)
    assert (info.value.status_code, info.value.code) == (503, "QUEUE_FULL")


def test_queue_unavailable_is_retried_only_with_retry_after(server, make_client):
    server.script("encode", err("QUEUE_UNAVAILABLE", retry_after=FAST))
    client = make_client()
    assert client.encode(MODEL, ITEM)["model"] == MODEL
    server.script("encode", err("QUEUE_UNAVAILABLE"), repeat=True)
    before = len(encode_calls(server))
    with pytest.raises(ServerError) as info:
        client.encode(MODEL, ITEM)
    assert info.value.code == "QUEUE_UNAVAILABLE"
    assert len(encode_calls(server)) == before + 1


def test_504_is_retried_only_when_waiting_for_capacity(server, make_client):
    server.script("encode", Reply(status=504, json={"detail": "deadline"}, headers={"Retry-After": FAST}))
    client = make_client()
    assert client.encode(MODEL, ITEM)["model"] == MODEL
    server.script(
        "encode", Reply(status=504, json={"detail": "deadline"}, headers={"Retry-After": FAST}), repeat=True
    )
    before = len(encode_calls(server))
    with pytest.raises(ServerError) as info:
        client.encode(MODEL, ITEM, wait_for_capacity=False)
    assert (info.value.status_code, info.value.message) == (504, "deadline")
    assert len(encode_calls(server)) == before + 1


# --------------------------------------------------------------------------- terminal answers


def test_input_too_long_raises_its_own_request_error(server, make_client):
    server.script("encode", err("INPUT_TOO_LONG", status=400))
    client = make_client()
    with pytest.raises(InputTooLongError) as info:
        client.encode(MODEL, ITEM)
    assert (info.value.status_code, info.value.code) == (400, "INPUT_TOO_LONG")
    assert isinstance(info.value, RequestError)


def test_4xx_is_terminal_and_keeps_status_code_message_and_param(server, make_client):
    server.script(
        "encode",
        Reply(
            status=400,
            json={
                "detail": {"code": "INVALID_INPUT", "message": "items must not be empty", "param": "items"}
            },
        ),
    )
    client = make_client()
    with pytest.raises(RequestError) as info:
        client.encode(MODEL, [])
    e = info.value
    assert (e.status_code, e.code, e.message, e.param) == (
        400,
        "INVALID_INPUT",
        "items must not be empty",
        "items",
    )
    assert len(encode_calls(server)) == 1


def test_unknown_model_is_a_404_request_error(server, make_client):
    server.script("encode", err("MODEL_NOT_FOUND", status=404))
    client = make_client()
    with pytest.raises(RequestError) as info:
        client.encode("no/such-model", ITEM)
    assert (info.value.status_code, info.value.code) == (404, "MODEL_NOT_FOUND")


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (err("INFERENCE_ERROR", status=500), "INFERENCE_ERROR"),
        (Reply(status=503, json={"detail": {"message": "mystery"}}, headers={"Retry-After": "1"}), None),
        (Reply(status=500, raw=b"<html>oops</html>", headers={"Content-Type": "text/html"}), None),
    ],
    ids=["500", "503-no-code", "500-html"],
)
def test_other_5xx_are_terminal_server_errors(server, make_client, reply, code):
    server.script("encode", reply, repeat=True)
    client = make_client()
    with pytest.raises(ServerError) as info:
        client.encode(MODEL, ITEM)
    assert info.value.code == code
    assert info.value.status_code == reply.status
    assert len(encode_calls(server)) == 1


def test_error_code_header_overrides_the_body_code(server, make_client):
    server.script(
        "encode",
        Reply(
            status=503,
            json={"detail": {"code": "INTERNAL_ERROR", "message": "x"}},
            headers={"X-SIE-Error-Code": "MODEL_LOADING", "Retry-After": FAST},
        ),
    )
    client = make_client()
    assert client.encode(MODEL, ITEM)["model"] == MODEL
    assert client.last_retry_count == 1


def test_redirects_are_not_followed(server, make_client):
    server.script("encode", Reply(status=307, headers={"Location": "http://example.invalid/x"}))
    client = make_client()
    with pytest.raises(RequestError) as info:
        client.encode(MODEL, ITEM)
    assert info.value.status_code == 307


# --------------------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize(
    "reply",
    [
        Reply(status=200, json={"model": MODEL, "items": []}),  # JSON where msgpack is required
        Reply(status=200, raw=b"\xc1\xc1 not msgpack", headers={"Content-Type": "application/msgpack"}),
        Reply(status=200, msgpack=[1, 2, 3]),
        Reply(status=200, msgpack={"model": MODEL}),
        Reply(status=200, msgpack={"model": MODEL, "items": [{"dense": {"values": [1.0, 2.0]}}]}),
        Reply(
            status=200,
            msgpack={"model": MODEL, "items": [{"dense": {"values": {"nd": True, "type": "<f4"}}}]},
        ),
    ],
    ids=["json", "garbage", "list", "no-items", "list-values", "str-keyed-array"],
)
def test_malformed_success_bodies_raise_request_error(server, make_client, reply):
    server.script("encode", reply)
    client = make_client()
    with pytest.raises(RequestError, match="Malformed encode MessagePack response"):
        client.encode(MODEL, ITEM)
    assert len(encode_calls(server)) == 1


def test_array_with_bin_dtype_is_rejected(server, make_client):
    bad = {b"nd": True, b"type": b"<f4", b"kind": b"", b"shape": [1], b"data": b"\x00\x00\x80\x3f"}
    server.script(
        "encode", Reply(status=200, msgpack={"model": MODEL, "items": [{"dense": {"values": bad}}]})
    )
    client = make_client()
    with pytest.raises(RequestError, match="Malformed"):
        client.encode(MODEL, ITEM)


def test_short_batch_raises_incomplete_batch_error(server, make_client):
    values = np.zeros(4, dtype=np.float32)
    server.script(
        "encode",
        Reply(status=200, msgpack={"model": MODEL, "items": [{"id": "a", "dense": {"values": values}}]}),
    )
    client = make_client()
    with pytest.raises(IncompleteBatchError) as info:
        client.encode(MODEL, [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}])
    e = info.value
    assert (e.expected, e.received, e.missing_ids) == (2, 1, ["b"])
    assert e.results[0]["id"] == "a"


def test_malformed_error_body_still_gives_a_typed_error(server, make_client):
    server.script("encode", Reply(status=400, raw=b"{not json", headers={"Content-Type": "application/json"}))
    client = make_client()
    with pytest.raises(RequestError) as info:
        client.encode(MODEL, ITEM)
    assert (info.value.status_code, info.value.code, info.value.message) == (400, None, "HTTP 400")


# --------------------------------------------------------------------------- slow answers and transport


def test_slow_answer_within_the_read_timeout_succeeds(server, make_client):
    server.script("encode", Reply(status=200, msgpack={"model": MODEL, "items": [{}]}, delay=0.3))
    client = make_client(read_timeout_s=5)
    assert client.encode(MODEL, ITEM) == {"model": MODEL}


def test_read_timeout_is_not_retried(server, make_client):
    server.script("encode", Reply(status=200, msgpack={"model": MODEL, "items": [{}]}, delay=3), repeat=True)
    client = make_client(read_timeout_s=0.3)
    with pytest.raises(SIEConnectionError):
        client.encode(MODEL, ITEM, provision_timeout_s=10)
    assert len(encode_calls(server)) == 1


def test_dropped_connection_is_retried_when_waiting(server, make_client):
    server.script("encode", Reply(drop=True))
    client = make_client()
    # the 5 s transport back-off is capped by the 1 s budget; the final attempt succeeds
    assert client.encode(MODEL, ITEM, provision_timeout_s=1.0)["model"] == MODEL
    assert len(encode_calls(server)) == 2


def test_dropped_connection_without_waiting_raises_connection_error(server, make_client):
    server.script("encode", Reply(drop=True), repeat=True)
    client = make_client()
    with pytest.raises(SIEConnectionError):
        client.encode(MODEL, ITEM, wait_for_capacity=False)
    assert len(encode_calls(server)) == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused(make_client):
    client = make_client(base_url=f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(SIEConnectionError):
        client.encode(MODEL, ITEM, wait_for_capacity=False)
    with pytest.raises(SIEConnectionError):
        client.encode(MODEL, ITEM, provision_timeout_s=0.3)
    assert client.last_retry_count == 1


@pytest.mark.timeout(60)
def test_nothing_listening_fails_after_quick_retries_naming_the_url(make_client, caplog):
    """Issue 36: with no server at the URL, the default 900 s budget is not spent on a refused
    connection; a few quick retries, each logged, then an error that names the URL."""
    url = f"http://127.0.0.1:{_closed_port()}"
    client = make_client(base_url=url)
    with caplog.at_level(logging.DEBUG, logger="sdk"), pytest.raises(SIEConnectionError) as info:
        client.encode(MODEL, ITEM)  # default budget and wait_for_capacity=True
    message = str(info.value)
    assert f"cannot connect to {url}" in message and "is the server" in message, message
    assert f"{len(UNREACHABLE_DELAYS_S) + 1} attempt(s)" in message
    assert client.last_retry_count == len(UNREACHABLE_DELAYS_S)
    notes = [r for r in caplog.records if r.name == "sdk" and "waiting for the server to accept" in r.message]
    assert len(notes) == len(UNREACHABLE_DELAYS_S) and url in notes[0].message
    assert notes[-1].levelno == logging.WARNING  # the wait adds up to a few seconds: said out loud


@pytest.mark.timeout(60)
def test_a_server_that_answered_before_is_waited_for_within_the_budget(make_client):
    """A refused connection from a server this client has talked to is a restart: the call waits
    for it within its budget, as for any transport failure, not just the quick retries."""
    gone = FakeServer().start()
    client = make_client(base_url=gone.url)
    client.list_models()  # an answer: the server exists
    gone.stop()
    with pytest.raises(SIEConnectionError) as info:
        client.encode(MODEL, ITEM, provision_timeout_s=1.0)
    assert "lost the connection to" in str(info.value)
    assert client.last_retry_count == 1  # the 5 s transport delay, capped by the 1 s budget


@pytest.mark.timeout(60)
def test_wait_for_capacity_fails_fast_when_nothing_listens(make_client):
    url = f"http://127.0.0.1:{_closed_port()}"
    client = make_client(base_url=url)
    with pytest.raises(SIEConnectionError) as info:
        client.wait_for_capacity("l4", poll_interval_s=0.05)
    assert str(info.value).startswith(f"wait_for_capacity: cannot connect to {url}")


def test_wait_for_capacity_says_what_it_waits_for_and_ends_with_the_budget(server, make_client, caplog):
    server.health = {"type": "gateway", "status": "no_workers", "cluster": {"worker_count": 0}, "workers": []}
    client = make_client()
    with caplog.at_level(logging.DEBUG, logger="sdk"), pytest.raises(ProvisioningError):
        client.wait_for_capacity("l4", timeout_s=0.5, poll_interval_s=0.1)
    notes = [r.message for r in caplog.records if r.name == "sdk" and "wait_for_capacity l4" in r.message]
    assert notes and "no worker of l4" in notes[0] and "budget left" in notes[0]
    assert len(server.calls("/health")) == len(notes) + 1


# --------------------------------------------------------------------------- score and extract share the matrix


def test_score_and_extract_follow_the_same_matrix(server, make_client):
    server.script("score", err("MODEL_LOADING", retry_after=FAST))
    server.script("extract", err("PROVISIONING", retry_after=FAST))
    client = make_client()
    scored = client.score(MODEL, {"text": "q"}, [{"text": "a"}])
    assert scored["scores"][0]["item_id"] == "item-0"
    assert client.last_retry_count == 1
    extracted = client.extract(MODEL, {"text": "Ada wrote"}, labels=["person"])
    assert extracted["entities"][0]["text"] == "Ada"
    assert client.last_retry_count == 1
    server.script("extract", err("MODEL_LOAD_FAILED", status=502))
    with pytest.raises(ModelLoadFailedError):
        client.extract(MODEL, {"text": "x"})
