"""Contract section 10 checks 19–21, 23–27 and 29 with the public sie-sdk 0.10.1 through the
gateway of a real cluster (nats-server, config service, worker IPC server, sidecar, gateways)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import yaml

from tests.integration.cluster.conftest import ADMIN, FAKE, POOL_ADMIN, spawn_pair
from tests.support.sdk312 import run_sdk

SDK_HEADERS = {"X-SIE-SDK-Version": "0.10.1"}


def sdk_run(script: str, url: str, **kw) -> dict:
    return run_sdk(script.replace("__D__", repr(FAKE)), url, **kw)


def warm(url: str, model: str, timeout: float = 60.0) -> None:
    """Encode until one answer is 200 (loads the model's profile on the cpu worker)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = httpx.post(
            url + f"/v1/encode/{model}", json={"items": [{"text": "warm"}]},
            headers={**SDK_HEADERS, "X-SIE-MACHINE-PROFILE": "cpu"}, timeout=60,
        )  # fmt: skip
        if last.status_code == 200:
            return
        time.sleep(0.5)
    raise AssertionError(
        f"{model} never answered 200: {last.status_code if last else None} {last.text if last else ''}"
    )


def test_check_19_scale_from_zero(cluster, sdk):
    out = sdk_run(
        """
        import time
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import ProvisioningError
        res = {}
        with SIEClient(URL) as c:
            t = time.monotonic()
            try:
                c.encode(__D__, {"text": "x"}, gpu="l4", wait_for_capacity=False)
                res["nowait"] = "no error"
            except ProvisioningError as e:
                res["nowait"] = [type(e).__name__, e.retry_after, time.monotonic() - t, c.last_retry_count]
            t = time.monotonic()
            try:
                c.encode(__D__, {"text": "x"}, gpu="l4", wait_for_capacity=True, provision_timeout_s=5)
                res["wait"] = "no error"
            except ProvisioningError as e:
                res["wait"] = [type(e).__name__, e.retry_after, time.monotonic() - t, c.last_retry_count]
        print(json.dumps(res))
        """,
        cluster.gateway_url,
    )
    # without waiting: the first 503 is the answer (no retry); waiting: retried until the budget
    # was spent (elapsed is a lower bound only: a busy machine makes it longer, never shorter)
    name, retry_after, _, retries = out["nowait"]
    assert name == "ProvisioningError" and retry_after and retries == 0, out["nowait"]
    name, retry_after, elapsed, retries = out["wait"]
    assert name == "ProvisioningError" and retry_after and elapsed >= 4 and retries >= 1, out["wait"]

    url = cluster.gateway_url + f"/v1/encode/{FAKE}"
    body = {"items": [{"text": "x"}]}
    r = httpx.post(url, json=body, headers={**SDK_HEADERS, "X-SIE-MACHINE-PROFILE": "l4"}, timeout=10)
    assert r.status_code == 503
    assert r.headers["X-SIE-Error-Code"] == "PROVISIONING" and r.headers["Retry-After"]
    assert r.json()["detail"]["code"] == "PROVISIONING"
    r = httpx.post(url, json=body, headers={"X-SIE-MACHINE-PROFILE": "l4"}, timeout=10)
    assert r.status_code == 202 and r.headers["Retry-After"] and r.json()["status"] == "provisioning"
    metrics = httpx.get(cluster.gateway_url + "/metrics").text
    assert 'sie_gateway_pending_demand{bundle="default",machine_profile="l4"} 1.0' in metrics


def test_check_19_capacity_arriving_within_budget_succeeds(cluster, sdk):
    """The waiting SDK call succeeds once an ``l4`` worker + sidecar come up during its budget."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(
            sdk_run,
            """
            import time
            from sie_sdk import SIEClient
            with SIEClient(URL) as c:
                t = time.monotonic()
                r = c.encode(__D__, {"text": "x"}, gpu="l4", provision_timeout_s=120)
                print(json.dumps({"shape": list(r["dense"].shape), "retries": c.last_retry_count,
                                  "elapsed": time.monotonic() - t}))
            """,
            cluster.gateway_url,
        )
        time.sleep(2)
        assert not fut.done()
        spawn_pair(cluster, "l4", "l4")
        out = fut.result(timeout=180)
    assert out["shape"] == [384] and out["retries"] >= 1


def test_check_20_gateway_deadline(cluster, sdk):
    warm(cluster.gateway_url, f"{FAKE}:slow-batch")  # load the slow profile through the normal gateway
    url = cluster.spawn_gateway("gw-deadline", SIE_GATEWAY_REQUEST_TIMEOUT_S="0.15")
    r = httpx.post(
        url + f"/v1/encode/{FAKE}:slow-batch", json={"items": [{"text": "late"}]},
        headers={**SDK_HEADERS, "X-SIE-MACHINE-PROFILE": "cpu"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 504, r.text
    assert isinstance(r.json(), dict) and ("detail" in r.json() or "error" in r.json())
    out = sdk_run(
        """
        import time
        from sie_sdk import SIEClient
        res = {}
        with SIEClient(URL) as c:
            for name, kw in (("nowait", {"wait_for_capacity": False}), ("wait", {"provision_timeout_s": 8})):
                t = time.monotonic()
                try:
                    c.encode(__D__ + ":slow-batch", {"text": "late"}, gpu="cpu", **kw)
                    res[name] = "no error"
                except Exception as e:
                    res[name] = [type(e).__name__, getattr(e, "status_code", None), time.monotonic() - t,
                                 c.last_retry_count]
        print(json.dumps(res))
        """,
        url,
    )
    name, status, _, retries = out["nowait"]
    assert name == "ServerError" and status == 504 and retries == 0, out["nowait"]
    # the default call retries the 504 until its budget is spent (then the SDK stops before a
    # retry it could not fit: ProvisioningError "timeout exceeded", or the last 504)
    name, status, elapsed, retries = out["wait"]
    assert name in ("ServerError", "ProvisioningError") and elapsed >= 4 and retries >= 1, out["wait"]


def test_check_21_queue_backpressure(cluster, sdk):
    url = cluster.spawn_gateway(
        "gw-tiny-queue", SIE_GATEWAY_MAX_STREAM_PENDING="2", SIE_GATEWAY_QUEUE_FULL_RETRY_AFTER_S="1"
    )
    warm(url, f"{FAKE}:slow-batch")
    target = url + f"/v1/encode/{FAKE}:slow-batch"
    headers = {**SDK_HEADERS, "X-SIE-MACHINE-PROFILE": "cpu"}

    def one(i: int) -> httpx.Response:
        return httpx.post(target, json={"items": [{"text": f"flood {i}"}]}, headers=headers, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(one, range(16)))
    statuses = sorted(r.status_code for r in answers)
    full = [r for r in answers if r.status_code == 503]
    assert full, statuses
    assert all(
        r.headers.get("X-SIE-Error-Code") == "QUEUE_FULL" and r.headers["Retry-After"] for r in full
    ), [r.text for r in full if r.headers.get("X-SIE-Error-Code") != "QUEUE_FULL"]
    assert set(statuses) <= {200, 503}, statuses

    rejected_before = _queue_full_count(url)
    out = sdk_run(
        """
        import concurrent.futures
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import RequestError
        res = {}
        def call(i):
            out = []
            with SIEClient(URL) as c:
                for j in range(4):
                    r = c.encode(__D__ + ":slow-batch", {"text": f"sdk {i} {j}"}, gpu="cpu",
                                 provision_timeout_s=120)
                    out.append([list(r["dense"].shape), c.last_retry_count])
            return out
        with concurrent.futures.ThreadPoolExecutor(12) as ex:
            res["calls"] = [x for xs in ex.map(call, range(12)) for x in xs]
        with SIEClient(URL) as c:
            try:
                c.encode(__D__, [{"text": "a"}, {"text": "b"}, {"text": "c"}], gpu="cpu")
                res["too_big"] = "no error"
            except RequestError as e:
                res["too_big"] = [e.status_code, e.code]
        print(json.dumps(res))
        """,
        url,
        timeout=300,
    )
    assert len(out["calls"]) == 48 and all(shape == [384] for shape, _ in out["calls"])  # no error surfaced
    # ... although the gateway did answer QUEUE_FULL during the SDK's flood (the SDK retried)
    assert _queue_full_count(url) > rejected_before
    assert any(retries >= 1 for _, retries in out["calls"]), out["calls"]
    assert out["too_big"] == [400, "INVALID_INPUT"]


def _queue_full_count(url: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("sie_gateway_rejected_requests_total") and 'reason="queue_full"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_check_23_pools(cluster, sdk):
    out = sdk_run(
        """
        import time
        import sie_sdk.client.sync as sync_mod
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import PoolError
        sync_mod.DEFAULT_LEASE_RENEWAL_INTERVAL_S = 1.5  # the SDK reads this module constant per cycle
        res = {}
        with SIEClient(URL, api_key=__POOL_ADMIN__) as c:  # one key for all: pool writes need the admin one
            c.create_pool("Eval-1", {"cpu": 1})
            p = c.get_pool("eval-1")
            res["get"] = [sorted(p), p["status"].get("state"), p["name"]]
            first = p["status"].get("last_renewed")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.5)
                p = c.get_pool("eval-1")
                if p["status"].get("state") == "active" and p["status"].get("last_renewed") != first:
                    break
            res["renewed"] = p["status"].get("last_renewed") != first
            res["state"] = p["status"].get("state")
            r = c.encode(__D__, {"text": "pool"}, gpu="eval-1/cpu", provision_timeout_s=30)
            res["encode"] = list(r["dense"].shape)
            res["delete"] = [c.delete_pool("eval-1"), c.delete_pool("eval-1"), c.get_pool("eval-1")]
            try:
                c.create_pool("x", {"not-a-profile": 1})
                res["bad"] = "no error"
            except PoolError as e:
                res["bad"] = type(e).__name__
        print(json.dumps(res))
        """.replace("__POOL_ADMIN__", repr(POOL_ADMIN)),
        cluster.gateway_url,
        timeout=120,
    )
    keys, state, name = out["get"]
    assert {"name", "spec", "status"} <= set(keys) and state in ("pending", "active") and name == "eval-1"
    assert out["renewed"] is True  # the SDK's own renew loop (caller's spelling) was accepted
    assert out["state"] == "active"
    assert out["encode"] == [384]
    assert out["delete"] == [True, False, None]
    assert out["bad"] == "PoolError"
    # the renew route answers the caller's spelling; unknown pools are 404
    with httpx.Client(base_url=cluster.gateway_url, timeout=10) as c:
        assert c.post("/v1/pools", json={"name": "Renew-Me"}).status_code == 401  # no admin token
        c.headers["Authorization"] = f"Bearer {POOL_ADMIN}"
        assert c.post("/v1/pools", json={"name": "Renew-Me", "gpus": {"cpu": 1}}).status_code == 201
        r = c.post("/v1/pools/Renew-Me/renew")
        assert r.status_code == 200 and r.json() == {"message": "Pool renewed"}
        assert c.delete("/v1/pools/renew-me").status_code == 200
        assert c.post("/v1/pools/Renew-Me/renew").status_code == 404


def test_check_24_26_27_capacity_headers_async(cluster, sdk):
    out = sdk_run(
        """
        import asyncio, logging, numpy as np
        from sie_sdk import SIEClient, SIEAsyncClient
        from sie_sdk.client.errors import RequestError
        records = []
        class H(logging.Handler):
            def emit(self, rec):
                records.append(rec.getMessage())
        logging.getLogger().addHandler(H())
        logging.getLogger().setLevel(logging.WARNING)
        res = {}
        with SIEClient(URL) as c:
            cap = c.get_capacity()
            res["cap"] = sorted(cap) if isinstance(cap, dict) else sorted(vars(cap))
            res["cap_cpu"] = c.get_capacity(gpu="cpu")["worker_count"]
            r = c.encode(__D__, {"text": "hi"}, gpu="cpu")
            res["request_id"] = (r.get("request") or {}).get("id")
            sync_vec = r["dense"]
        async def run():
            async with SIEAsyncClient(URL) as ac:
                return (await ac.encode(__D__, {"text": "hi"}, gpu="cpu"))["dense"]
        avec = asyncio.run(run())
        res["async_equal"] = bool(np.array_equal(sync_vec, avec))
        res["warnings"] = [m for m in records if "version" in m.lower() or "skew" in m.lower()]
        print(json.dumps(res))
        """,
        cluster.gateway_url,
    )
    assert {"status", "worker_count", "configured_gpu_types", "live_gpu_types", "workers"} <= set(out["cap"])
    assert out["cap_cpu"] >= 1
    assert out["async_equal"] is True
    assert out["warnings"] == []
    r = httpx.post(
        cluster.gateway_url + f"/v1/encode/{FAKE}", json={"items": [{"text": "hi"}]},
        headers={**SDK_HEADERS, "Accept": "application/json"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 200
    major, minor = (int(x) for x in r.headers["X-SIE-Server-Version"].split(".")[:2])
    assert major == 0 and abs(minor - 10) <= 1
    assert r.headers["X-SIE-Request-ID"]
    if out["request_id"] is not None:
        assert isinstance(out["request_id"], str) and out["request_id"]


def test_check_24_against_a_non_gateway_raises(cluster, sdk):
    """get_capacity against a server that is not a gateway (the config service) → RequestError."""
    out = sdk_run(
        """
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import RequestError
        with SIEClient(URL) as c:
            try:
                c.get_capacity()
                print(json.dumps({"err": None}))
            except RequestError as e:
                print(json.dumps({"err": [type(e).__name__, e.status_code, e.code]}))
        """,
        cluster.config_url,
    )
    assert out["err"] is not None and out["err"][0] == "RequestError"


def test_check_25_auth(cluster, sdk):
    url = cluster.spawn_gateway(
        "gw-auth", token="tok-1", SIE_AUTH_MODE="token", SIE_AUTH_TOKENS="tok-1,tok-2"
    )
    out = sdk_run(
        """
        from sie_sdk import SIEClient
        from sie_sdk.client.errors import RequestError
        res = {}
        for name, key in (("anon", ""), ("wrong", "wrong")):
            with SIEClient(URL, api_key=key) as c:
                try:
                    c.encode(__D__, {"text": "x"}, gpu="cpu")
                    res[name] = "no error"
                except RequestError as e:
                    res[name] = [type(e).__name__, e.status_code]
        with SIEClient(URL, api_key="tok-2") as c:
            res["ok"] = list(c.encode(__D__, {"text": "x"}, gpu="cpu")["dense"].shape)
        print(json.dumps(res))
        """,
        url,
    )
    assert out["anon"] == ["RequestError", 401]
    assert out["wrong"] == ["RequestError", 401]
    assert out["ok"] == [384]
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/readyz").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401


NEW_MODEL = """\
sie_id: acme/fake-copy
package_backed: true
inputs: {text: true}
tasks:
  encode:
    dense: {dim: 384}
profiles:
  default:
    adapter_path: worker.adapters.fake:FakeAdapter
    max_batch_tokens: 4096
"""


def test_check_29_config_round_trip_and_gateway_mirror(cluster):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=cluster.config_url, headers=admin, timeout=10) as cfg:
        epoch0 = cfg.get("/v1/configs/epoch").json()["epoch"]
        r = cfg.post("/v1/configs/models", content=NEW_MODEL, headers={"Idempotency-Key": "k-1"})
        assert r.status_code == 201, r.text
        assert r.json()["created_profiles"] == ["default"]
        epoch1 = cfg.get("/v1/configs/epoch").json()["epoch"]
        assert epoch1 == epoch0 + 1
        r = cfg.post("/v1/configs/models", content=NEW_MODEL)
        assert r.status_code == 200 and r.json()["existing_profiles_skipped"] == ["default"]
        assert cfg.get("/v1/configs/epoch").json()["epoch"] == epoch1
        r = cfg.post("/v1/configs/models", content=NEW_MODEL + "max_sequence_length: 64\n",
                     headers={"Idempotency-Key": "k-1"})  # fmt: skip
        assert r.status_code == 422 and r.json()["detail"]["error"] == "idempotency_mismatch"
        r = cfg.post("/v1/configs/models", content=NEW_MODEL.replace("4096", "2048"))
        assert r.status_code == 409 and r.json()["detail"]["error"] == "content_conflict"
        r = cfg.post("/v1/configs/models", content=NEW_MODEL + "colour: blue\n")
        assert r.status_code == 422 and r.json()["detail"]["error"] == "validation_error"
        export = cfg.get("/v1/configs/export").json()
        assert export["epoch"] == epoch1
        assert "acme/fake-copy" in [m["model_id"] for m in export["models"]]

    gw = cluster.gateway_url
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = [m["name"] for m in httpx.get(gw + "/v1/models").json()["models"]]
        if "acme/fake-copy" in names:
            break
        time.sleep(0.1)
    assert "acme/fake-copy" in names
    assert httpx.get(gw + "/v1/configs/epoch").json()["epoch"] == epoch1
    mirror = httpx.get(gw + "/v1/configs/models/acme/fake-copy")
    assert mirror.status_code == 200 and yaml.safe_load(mirror.text)["sie_id"] == "acme/fake-copy"
    listing = httpx.get(gw + "/v1/configs/models").json()["models"]
    assert {"model_id": "acme/fake-copy", "profiles": ["default"], "source": "api"} in listing
    r = httpx.post(gw + "/v1/configs/models", content=NEW_MODEL, headers=admin)
    assert r.status_code == 401  # the config service's admin token opens nothing on a gateway
    pool_admin = {"Authorization": f"Bearer {POOL_ADMIN}"}
    r = httpx.post(gw + "/v1/configs/models", content=NEW_MODEL, headers=pool_admin)
    assert r.status_code == 405  # and the gateway's own admin token finds a read-only mirror
    metrics = httpx.get(gw + "/metrics").text
    assert f"sie_gateway_config_epoch {float(epoch1)}" in metrics


def test_watch_cluster_status_and_index_with_public_sdk(cluster, sdk):
    """``watch()`` in auto mode finds the gateway (/health says type gateway) and streams
    /ws/cluster-status frames shaped like /health (contract 5.5)."""
    out = sdk_run(
        """
        import itertools, json
        from sie_sdk import SIEClient
        with SIEClient(URL) as c:
            frames = [json.loads(json.dumps(m, default=str)) for m in itertools.islice(c.watch(), 2)]
        print(json.dumps({"frames": frames}))
        """,
        cluster.gateway_url,
    )
    frames = out["frames"]
    assert len(frames) == 2 and all(
        f["type"] == "gateway" and f["cluster"]["worker_count"] >= 1 for f in frames
    )
    assert any(w["loaded_models"] for w in frames[-1]["workers"])
    index = httpx.get(cluster.gateway_url + "/").json()
    assert index["type"] == "gateway" and "/ws/cluster-status" in index["routes"]


def test_our_sdk_watch_and_wait_for_capacity_against_the_gateway(cluster):
    """Our SDK's ``watch()`` finds /ws/cluster-status; ``wait_for_capacity`` returns for a profile with
    a worker (also after a warm-up encode) and raises ProvisioningError for one without."""
    import asyncio
    import itertools

    import pytest

    from sdk import ProvisioningError, RequestError, SIEAsyncClient, SIEClient

    with SIEClient(cluster.gateway_url) as c:
        frames = list(itertools.islice(c.watch(), 2))
        assert all(f["type"] == "gateway" and f["cluster"]["worker_count"] >= 1 for f in frames)
        cap = c.wait_for_capacity("cpu", timeout_s=60, poll_interval_s=0.2)
        assert cap["worker_count"] >= 1 and all(w["gpu"] == "cpu" for w in cap["workers"])
        cap = c.wait_for_capacity("cpu", model=FAKE, timeout_s=60)
        assert any(FAKE in w["loaded_models"] for w in cap["workers"])
        with pytest.raises(ProvisioningError) as exc:  # no worker of this kind (earlier tests start l4 ones)
            c.wait_for_capacity("a100-80gb", timeout_s=0.5, poll_interval_s=0.1)
        assert exc.value.gpu == "a100-80gb"
        with pytest.raises(RequestError):  # a gateway has no /ws/status
            next(c.watch(mode="worker"))

    async def run_async() -> tuple[dict, dict]:
        async with SIEAsyncClient(cluster.gateway_url) as ac:
            stream = ac.watch()
            frame = await anext(stream)
            await stream.aclose()
            return frame, await ac.wait_for_capacity("cpu", timeout_s=60, poll_interval_s=0.2)

    frame, cap = asyncio.run(run_async())
    assert frame["type"] == "gateway" and cap["worker_count"] >= 1
