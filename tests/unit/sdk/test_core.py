"""The sans-I/O core on its own: a call driven step by step by hand, with no client and no socket."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.codec import packb, unpackb
from sdk import ProvisioningError, SIEClient, SIEConnectionError
from sdk import _calls as C
from sdk._core import Failure, Renewal, Request, Response, Session, Sleep
from sdk._retry import Transport

MSGPACK = {"Content-Type": "application/msgpack"}


def session(**kw) -> Session:
    clock = iter(float(t) for t in range(1000))
    settings = dict(
        timeout_s=None,
        api_key="k",
        admin_key=None,
        gpu=None,
        priority=None,
        options={"profile": "p"},
        base_url_headers=None,
        connect_timeout_s=None,
        read_timeout_s=None,
        remote=None,
    )
    settings.update(kw)
    s = Session.configure("http://h:1", **settings)
    s.clock = lambda: next(clock)
    return s


def finish(call, reply):
    with pytest.raises(StopIteration) as done:
        call.send(reply)
    return done.value.value


def test_an_encode_is_one_request_built_by_the_core_and_its_answer_read_by_it():
    s = session()
    call = C.encode(s, "org/m", {"id": "a", "text": "hi"}, is_query=True, gpu="pool/l4")
    request = call.send(None)
    assert isinstance(request, Request)
    assert (request.method, request.url) == ("POST", "http://h:1/v1/encode/org/m")
    assert request.headers["Authorization"] == "Bearer k"
    assert request.headers["X-SIE-Pool"] == "pool" and request.headers["X-SIE-MACHINE-PROFILE"] == "l4"
    assert unpackb(request.body) == {
        "items": [{"id": "a", "text": "hi"}],
        "params": {"options": {"profile": "p", "is_query": True}},
    }
    answer = {"model": "org/m", "items": [{"id": "a", "dense": {"values": np.array([1.0, 2.0])}}]}
    result = finish(call, Response(200, {**MSGPACK, "X-SIE-Model-Revision": "r1"}, packb(answer)))
    assert result["id"] == "a" and result["dense"].tolist() == [1.0, 2.0]
    assert s.server_seen and s.last_model_revision == "r1" and s.last_retry_count == 0


def test_a_provisioning_answer_is_a_sleep_then_the_same_request_again():
    s = session()
    call = C.score(s, "m", {"text": "q"}, [{"id": "0", "text": "x"}], wait_for_capacity=True)
    first = call.send(None)
    busy = Response(503, {"X-SIE-Error-Code": "PROVISIONING", "Retry-After": "2"}, b"")
    assert call.send(busy) == Sleep(2.0)
    again = call.send(None)
    assert isinstance(again, Request) and again.body == first.body
    answer = {"model": "m", "scores": [{"item_id": "0", "score": 0.5, "rank": 0}]}
    result = finish(call, Response(200, MSGPACK, packb(answer)))
    assert result["scores"] == [{"item_id": "0", "score": 0.5, "rank": 0}]
    assert s.last_retry_count == 1


def test_without_waiting_for_capacity_provisioning_ends_the_call():
    call = C.encode(session(), "m", {"text": "x"}, gpu="l4", wait_for_capacity=False)
    call.send(None)
    with pytest.raises(ProvisioningError) as info:
        call.send(Response(503, {"X-SIE-Error-Code": "PROVISIONING"}, b""))
    assert info.value.gpu == "l4"


def test_a_server_never_reached_fails_after_the_quick_retries():
    call = C.encode(session(), "m", {"text": "x"})
    step = call.send(None)
    refused = Failure(Transport.UNREACHED, ConnectionRefusedError("refused"))
    with pytest.raises(SIEConnectionError, match="cannot connect to http://h:1"):
        while True:
            assert isinstance(step, Request)
            assert isinstance(call.send(refused), Sleep)
            step = call.send(None)


def test_pool_calls_start_and_stop_the_renewal_through_steps():
    s = session(admin_key="adm")
    create = C.create_pool(s, "p", {"l4": 1})
    request = create.send(None)
    assert request.headers["Authorization"] == "Bearer adm" and request.url == "http://h:1/v1/pools"
    assert create.send(Response(200, {}, b'{"name": "p", "status": {"state": "pending"}}')) == Renewal(
        "p", True
    )
    assert finish(create, None) is None
    delete = C.delete_pool(s, "p")
    assert delete.send(None) == Renewal("p", False)
    assert delete.send(None).method == "DELETE"
    assert finish(delete, Response(404, {}, b"")) is False


def test_a_lease_renewal_retries_with_backoff_and_runs_until_stopped():
    s = session()
    renewal = C.renew_lease(s, "p", 6.0)
    assert renewal.send(None) == Sleep(6.0)
    request = renewal.send(None)
    assert request.url == "http://h:1/v1/pools/p/renew"
    assert renewal.send(Response(500, {}, b"")) == Sleep(0.1)  # 1 s of backoff at a tenth of 60 s
    assert renewal.send(None) == request
    assert renewal.send(Response(200, {}, b"{}")) == Sleep(6.0)  # the next cycle
    renewal.close()


def test_client_methods_are_the_core_calls_with_their_signatures():
    import inspect

    assert SIEClient.encode.__doc__ == C.encode.__doc__
    params = inspect.signature(SIEClient.score).parameters
    assert list(params)[:4] == ["self", "model", "query", "items"]
    assert params["max_oom_retries"].default == 3
