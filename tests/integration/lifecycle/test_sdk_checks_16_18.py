"""Contract section 10 checks 16–18 with the public sie-sdk 0.10.1 against ``sie serve``.

16 cold load retry (``sie-fake:slow-load``), 17 terminal load failure (``sie-fake:fail-load``),
18 OOM retry (``sie-fake:oom-3rd``: dispatches 3 and 4 raise OOM; with no sibling to evict and a
single-item batch to split, the worker answers 503 RESOURCE_EXHAUSTED once).
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.sdk312 import run_sdk
from tests.support.serve import ServeProcess

FAST_RETRIES = {
    "SIE_MODEL_LOADING_RETRY_AFTER_S": "1",
    "SIE_RESOURCE_EXHAUSTED_RETRY_AFTER_S": "1",
    "SIE_MEMORY_MONITOR_INTERVAL_S": "0",
}


@pytest.fixture
def server(tmp_path):
    with ServeProcess(env={**FAST_RETRIES, "SIE_DISK_CACHE_DIR": str(tmp_path / "cache")}) as srv:
        yield srv


def raw_encode(server, model: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/encode/{model}",
        json={"items": [{"text": "raw"}]},
        headers={"Accept": "application/json"},
        timeout=30,
    )


def test_check_16_cold_load_retry(server, sdk):
    out = run_sdk(
        """
        from sie_sdk import SIEClient
        with SIEClient(URL) as c:
            r = c.encode("sie-fake:slow-load", {"text": "hello"}, provision_timeout_s=120)
            print(json.dumps({"shape": list(r["dense"].shape), "retries": c.last_retry_count}))
        """,
        server.url,
    )
    assert out["shape"] == [384]
    assert out["retries"] >= 1
    # a raw POST to a model in the same (cold) state: slow-batch is another load of sie-fake
    r = raw_encode(server, "sie-fake:slow-batch")
    assert r.status_code == 503
    assert "Retry-After" in r.headers
    assert (
        r.headers.get("X-SIE-Error-Code") == "MODEL_LOADING" or r.json()["detail"]["code"] == "MODEL_LOADING"
    )


def test_check_17_terminal_load_failure(server, sdk):
    out = run_sdk(
        """
        import time
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import ModelLoadFailedError
        with SIEClient(URL) as c:
            t0 = time.monotonic()
            try:
                c.encode("sie-fake:fail-load", {"text": "hello"}, provision_timeout_s=3600)
                res = None
            except ModelLoadFailedError as e:
                res = [e.status_code, e.code, type(e.permanent).__name__, e.attempts]
            print(json.dumps({"err": res, "seconds": time.monotonic() - t0}))
        """,
        server.url,
    )
    status, code, permanent_type, attempts = out["err"]
    assert (status, code, permanent_type) == (502, "MODEL_LOAD_FAILED", "bool")
    assert attempts >= 1
    # terminal: the call ended with the error, not by spending its hour of retry budget (which
    # run_sdk's own timeout would have cut short, failing the test)
    r = raw_encode(server, "sie-fake:fail-load")
    assert r.status_code == 502
    assert "Retry-After" not in r.headers
    assert r.json()["detail"]["code"] == "MODEL_LOAD_FAILED"


def test_check_18_oom_retry(server, sdk):
    out = run_sdk(
        """
        from sie_sdk import SIEClient
        with SIEClient(URL) as c:
            shapes, retries = [], []
            for i in range(5):
                r = c.encode("sie-fake:oom-3rd", {"text": f"call {i}"}, provision_timeout_s=120)
                shapes.append(list(r["dense"].shape))
                retries.append(c.last_retry_count)
            print(json.dumps({"shapes": shapes, "retries": retries}))
        """,
        server.url,
    )
    assert out["shapes"] == [[384]] * 5  # every call succeeds
    assert max(out["retries"]) >= 1  # one of them after a RESOURCE_EXHAUSTED answer


def test_check_18_no_oom_retries_raises_resource_exhausted(server, sdk):
    out = run_sdk(
        """
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import ResourceExhaustedError
        with SIEClient(URL) as c:
            res = []
            for i in range(3):  # dispatch 1 comes after the cold load; the third call's dispatch OOMs
                try:
                    c.encode("sie-fake:oom-3rd", {"text": f"call {i}"}, provision_timeout_s=120,
                             max_oom_retries=0)
                    res.append("ok")
                except ResourceExhaustedError as e:
                    res.append([type(e).__name__, e.status_code, e.code])
            print(json.dumps(res))
        """,
        server.url,
    )
    assert out == ["ok", "ok", ["ResourceExhaustedError", 503, "RESOURCE_EXHAUSTED"]]
