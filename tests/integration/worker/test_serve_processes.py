"""``SIE_MODEL_PROCESSES=2``: two whole workers share the port, and both go when the first goes."""

from __future__ import annotations

import time

import httpx

from protocol.codec import packb, unpackb
from tests.support.processes import alive, children
from tests.support.serve import ServeProcess


def test_sibling_processes_share_the_port_and_stop_with_the_first():
    with ServeProcess(env={"SIE_MODEL_PROCESSES": "2", "SIE_PRELOAD_MODELS": "sie-fake"}) as srv:
        kids = children(srv.proc.pid)
        assert len(kids) == 1 and alive(kids[0])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the sibling preloads on its own; wait until both answer
            oks = [httpx.get(srv.url + "/readyz").status_code == 200 for _ in range(20)]
            if all(oks):
                break
            time.sleep(0.5)
        for i in range(30):  # a new connection each time: the kernel spreads them over both
            r = httpx.post(
                srv.url + "/v1/encode/sie-fake",
                content=packb({"items": [{"text": f"t{i}"}]}),
                headers={"Content-Type": "application/msgpack"},
            )
            assert r.status_code == 200, r.text
            assert unpackb(r.content)["items"][0]["dense"]["values"].shape == (384,)
        assert alive(
            kids[0]
        )  # it bound the shared port (a second bind without SO_REUSEPORT would have failed)
    deadline = time.monotonic() + 20
    while alive(kids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(kids[0])
