"""Pools in the JetStream KV bucket (shared by replicas), auth, DLQ forwarding."""

from __future__ import annotations

import json

import pytest

from protocol.codec import packb, unpackb
from tests.integration.gateway.conftest import DENSE
from tests.integration.gateway.fake_worker import FakeWorker
from tests.integration.gateway.test_gateway_flow import SDK, post, wait_workers
from tests.support.polling import wait_until

JSON = {"Accept": "application/json"}
POOL_ADMIN = "pool-admin-1"  # admin routes need the gateway's admin token in every auth mode
ADMIN_JSON = {**JSON, "Authorization": f"Bearer {POOL_ADMIN}"}


async def test_pool_lifecycle_shared_by_replicas_and_routing(nats_server, start_gateway):
    g1 = await start_gateway(admin_token=POOL_ADMIN)
    g2 = await start_gateway(admin_token=POOL_ADMIN)
    async with g1.session.post(
        g1.url("/v1/pools"), json={"name": "Eval-1", "gpus": {"l4": 1}}, headers=ADMIN_JSON
    ) as r:
        assert r.status == 201
        created = await r.json()
    assert created["name"] == "eval-1" and created["status"]["state"] == "pending"
    # the other replica sees it (same KV bucket)
    async with g2.session.get(g2.url("/v1/pools/EVAL-1"), headers=JSON) as r:
        assert r.status == 200 and (await r.json())["spec"]["gpus"] == {"l4": 1}
    # pending pool: provisioning for pool requests
    hdr = {**SDK, "X-SIE-Pool": "eval-1", "X-SIE-MACHINE-PROFILE": "l4"}
    status, headers, _ = await post(g2, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, hdr)
    assert status == 503 and headers["X-SIE-Error-Code"] == "PROVISIONING"
    w = await FakeWorker(nats_server.url, "l4-1", profile="l4").start()
    try:
        await wait_workers(g2)
        async with g2.session.get(g2.url("/v1/pools/eval-1"), headers=JSON) as r:
            view = await r.json()
        assert view["status"]["state"] == "active"
        assert [a["name"] for a in view["status"]["assigned_workers"]] == ["l4-1"]
        status, _, body = await post(g2, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, hdr)
        assert status == 200, body
        assert w.seen[-1].job.machine_profile == "l4"
        # gpu="pool/profile" inside the profile header works too
        status, _, _ = await post(g1, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, {**SDK, "X-SIE-MACHINE-PROFILE": "eval-1/l4"})  # fmt: skip
        assert status == 200
    finally:
        await w.stop()
    async with g1.session.post(g1.url("/v1/pools/Eval-1/renew"), headers={**SDK, **ADMIN_JSON}) as r:
        assert r.status == 200
    async with g2.session.get(g2.url("/v1/pools"), headers=JSON) as r:
        assert {p["name"] for p in (await r.json())["pools"]} == {"default", "eval-1"}
    async with g2.session.delete(g2.url("/v1/pools/Eval-1"), headers=ADMIN_JSON) as r:
        assert r.status == 200
    async with g1.session.delete(g1.url("/v1/pools/eval-1"), headers=ADMIN_JSON) as r:
        assert r.status == 404 and (await r.json())["detail"]["code"] == "NOT_FOUND"
    async with g1.session.get(g1.url("/v1/pools/eval-1"), headers=JSON) as r:
        assert r.status == 404
    async with g1.session.delete(g1.url("/v1/pools/default"), headers=ADMIN_JSON) as r:
        assert r.status == 403
    # unknown pool on a request: 404 naming the pool
    status, _, body = await post(
        g1, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, {**SDK, "X-SIE-Pool": "ghost"}
    )
    assert status == 404 and "ghost" in body["detail"]["message"]


async def test_pool_validation_and_expiry(start_gateway):
    g = await start_gateway(pool_ttl_s=1.0, admin_token=POOL_ADMIN)
    for body in (
        {"name": "x", "gpus": {"not-a-profile": 1}},
        {"name": "bad name!"},
        {"name": "x", "pinned_models": ["no/such"]},
        {"name": "x", "minimum_worker_count": -1},
        {"name": "x", "bundle": "nope"},
        {"name": "x", "ttl_seconds": 999999},
    ):
        async with g.session.post(g.url("/v1/pools"), json=body, headers=ADMIN_JSON) as r:
            assert r.status == 400, body
            assert isinstance((await r.json())["detail"], dict)
    short = {"name": "short", "pinned_models": [DENSE]}
    async with g.session.post(g.url("/v1/pools"), json=short, headers=ADMIN_JSON) as r:
        assert r.status == 201

    async def expired() -> bool:
        async with g.session.get(g.url("/v1/pools/short")) as r:
            return r.status == 404

    await wait_until(expired, what="the pool's lease to expire")
    async with g.session.post(g.url("/v1/pools/short/renew"), headers=ADMIN_JSON) as r:
        assert r.status == 404


async def test_pool_writes_are_closed_without_an_admin_token_even_with_auth_off(start_gateway):
    g = await start_gateway()  # SIE_AUTH_MODE none, no SIE_ADMIN_TOKEN
    writes = [
        ("POST", "/v1/pools", {"name": "p"}),
        ("POST", "/v1/pools/p/renew", None),
        ("DELETE", "/v1/pools/p", None),
        ("POST", "/v1/admin/anything", None),
    ]
    for method, path, body in writes:
        for headers in (JSON, {**JSON, "Authorization": "Bearer anything"}):
            async with g.session.request(method, g.url(path), json=body, headers=headers) as r:
                assert r.status == 403, (method, path)
                detail = (await r.json())["detail"]
                assert detail["code"] == "FORBIDDEN" and "set SIE_ADMIN_TOKEN" in detail["message"]
    async with g.session.get(g.url("/v1/pools"), headers=JSON) as r:
        assert r.status == 200  # reads stay open with auth off
    async with g.session.get(g.url("/v1/models"), headers=JSON) as r:
        assert r.status == 200


async def test_pool_writes_need_the_admin_token_with_auth_off(start_gateway):
    g = await start_gateway(admin_token=POOL_ADMIN)  # SIE_AUTH_MODE none
    body = {"name": "p", "gpus": {"l4": 1}}
    async with g.session.post(g.url("/v1/pools"), json=body, headers=JSON) as r:
        assert r.status == 401 and (await r.json())["detail"]["code"] == "UNAUTHORIZED"
    wrong = {**JSON, "Authorization": "Bearer not-the-admin"}
    async with g.session.post(g.url("/v1/pools"), json=body, headers=wrong) as r:
        assert r.status == 401 and (await r.json())["detail"]["code"] == "UNAUTHORIZED"
    async with g.session.post(g.url("/v1/pools"), json=body, headers=ADMIN_JSON) as r:
        assert r.status == 201
    async with g.session.post(g.url("/v1/pools/p/renew"), headers=JSON) as r:
        assert r.status == 401
    async with g.session.post(g.url("/v1/pools/p/renew"), headers=ADMIN_JSON) as r:
        assert r.status == 200
    async with g.session.get(g.url("/v1/pools/p"), headers=JSON) as r:
        assert r.status == 200  # a read: no token with auth off
    async with g.session.delete(g.url("/v1/pools/p"), headers=JSON) as r:
        assert r.status == 401
    async with g.session.delete(g.url("/v1/pools/p"), headers=ADMIN_JSON) as r:
        assert r.status == 200
    status, _, _ = await post(g, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, SDK)
    assert status == 503  # inference stays open with auth off (no worker: provisioning)


async def test_our_sdk_sends_its_admin_key_on_pool_writes(start_gateway):
    from sdk import SIEAsyncClient
    from sdk.errors import PoolError

    g = await start_gateway(auth_mode="token", auth_tokens=["inf-1"], admin_token=POOL_ADMIN)
    base = g.url("/").rstrip("/")
    async with SIEAsyncClient(base, api_key="inf-1") as plain:
        with pytest.raises(PoolError) as refused:
            await plain.create_pool("sdk-pool", {"l4": 1})
        assert refused.value.status_code == 403 and refused.value.code == "FORBIDDEN"
    async with SIEAsyncClient(base, api_key="inf-1", admin_key=POOL_ADMIN, lease_renewal_interval_s=0.2) as c:
        await c.create_pool("sdk-pool", {"l4": 1})
        first = (await c.get_pool("sdk-pool"))["status"]["last_renewed"]  # a read, with the API key

        async def renewed() -> bool:
            return (await c.get_pool("sdk-pool"))["status"]["last_renewed"] != first

        await wait_until(renewed, what="the SDK's renewal, with the admin key, accepted")
        assert await c.delete_pool("sdk-pool") is True


async def test_readyz_waits_one_heartbeat_interval_for_the_worker_registry(nats_server, start_gateway):
    g = await start_gateway(gateway_worker_warmup_s=1.0)
    async with g.session.get(g.url("/readyz")) as r:
        assert r.status == 503 and (await r.json())["reason"] == "worker registry warming up"

    async def ready() -> bool:
        async with g.session.get(g.url("/readyz")) as r:
            return r.status == 200

    await wait_until(ready, what="readyz 200 after the warm-up")


async def test_auth_tokens_admin_and_probes(nats_server, start_gateway):
    g = await start_gateway(auth_mode="token", auth_tokens=["inf-1"], admin_token="adm-1")
    async with g.session.get(g.url("/healthz")) as r:
        assert r.status == 200
    async with g.session.get(g.url("/readyz")) as r:
        assert r.status == 200
    async with g.session.get(g.url("/v1/models")) as r:
        assert r.status == 401 and (await r.json())["detail"]["code"] == "UNAUTHORIZED"
    async with g.session.get(g.url("/v1/models"), headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401
    async with g.session.get(g.url("/v1/models"), headers={"Authorization": "Bearer inf-1"}) as r:
        assert r.status == 200
    status, _, _ = await post(
        g, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]}, {**SDK, "Authorization": "Bearer inf-1"}
    )
    assert status == 503  # authorised; no worker yet
    async with g.session.post(
        g.url("/v1/pools"), json={"name": "p"}, headers={"Authorization": "Bearer inf-1"}
    ) as r:
        assert r.status == 403 and (await r.json())["detail"]["code"] == "FORBIDDEN"
    async with g.session.post(
        g.url("/v1/pools"), json={"name": "p"}, headers={"Authorization": "Bearer adm-1"}
    ) as r:
        assert r.status == 201
    async with g.session.get(g.url("/v1/pools/p"), headers={"Authorization": "Bearer inf-1"}) as r:
        assert r.status == 200
    async with g.session.get(g.url("/metrics")) as r:
        assert r.status == 401
    # token mode without an admin token: admin routes are off, whatever the token
    g = await start_gateway(auth_mode="token", auth_tokens=["inf-1"])
    async with g.session.post(
        g.url("/v1/pools"), json={"name": "p"}, headers={"Authorization": "Bearer inf-1"}
    ) as r:
        assert r.status == 403 and "SIE_ADMIN_TOKEN" in (await r.json())["detail"]["message"]


async def test_dlq_forwarding_fails_the_item_at_once(nats_server, start_gateway):
    """A consumer with max_deliver=1 that never acks trips the advisory; the gateway forwards it."""
    g = await start_gateway(gateway_request_timeout_s=20.0)

    async def never(item, worker):
        return None

    w = FakeWorker(nats_server.url, "w1", handler=never, ack_wait_s=1.0, max_deliver=1)
    await w.start()
    try:
        await wait_workers(g)
        js = g.nc.jetstream()
        status, _, body = await post(g, f"/v1/encode/{DENSE}", {"items": [{"text": "a"}]})
        assert status == 500 and "dead-lettered" in body["detail"]["message"]
        dlq = await js.pull_subscribe("sie.dlq.>", stream="DEAD_LETTERS")
        msgs = await dlq.fetch(1, timeout=5)
        assert msgs[0].subject == "sie.dlq.test__dense-model"
        adv = json.loads(msgs[0].data)
        assert adv["stream"] == "WORK_POOL_default" and adv["consumer"] == "default_cpu_default"
    finally:
        await w.stop()


async def test_msgpack_pass_through_keeps_worker_bytes(nats_server, start_gateway):
    """The worker's item bytes reach the client unchanged (no re-encoding in the gateway)."""
    from protocol.work import WorkResult

    blob = packb(
        {"id": "x", "custom": [1, 2, 3], "dense": {"dims": 1, "dtype": "float32", "values": b"\x00"}}
    )

    async def fixed(item, worker):
        return WorkResult(item.work_item_id, item.request_id, item.item_index, True, result_msgpack=blob)

    g = await start_gateway()
    w = await FakeWorker(nats_server.url, "w1", handler=fixed).start()
    try:
        await wait_workers(g)
        async with g.session.post(
            g.url(f"/v1/encode/{DENSE}"), data=packb({"items": [{"text": "a"}]}), headers=SDK
        ) as r:
            raw = await r.read()
        assert blob in raw
        assert unpackb(raw)["items"][0]["custom"] == [1, 2, 3]
    finally:
        await w.stop()
