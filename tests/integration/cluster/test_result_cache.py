"""Issue 17: the result cache shared by every gateway, and the priority classes, through a real
cluster (``deploy.launcher.Cluster``: nats-server, config service, gateway, sidecar, worker).

"No work published" is read from the pool work stream itself: its last sequence number moves by
one for every item the gateways publish, and by nothing for an item answered from the cache.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import numpy as np
import pytest

from protocol.codec import unpackb
from protocol.subjects import lane_durable, pool_stream_name
from tests.integration.cluster.conftest import ADMIN, FAKE, POOL_ADMIN
from tests.support.sdk312 import run_sdk

MSGPACK = {"Content-Type": "application/json", "Accept": "application/msgpack"}
CACHED_MODEL = "acme/fake-cached"
CACHED_YAML = """
sie_id: acme/fake-cached
package_backed: true
inputs: {text: true}
tasks:
  encode:
    dense: {dim: 16}
max_sequence_length: 256
profiles:
  default:
    adapter_path: worker.adapters.fake:FakeAdapter
    max_batch_tokens: 4096
"""
# the same model with one more profile: a config change (new hash) that leaves ``default`` as it was
CACHED_YAML_V2 = (
    CACHED_YAML
    + """  second:
    adapter_path: worker.adapters.fake:FakeAdapter
    max_batch_tokens: 2048
"""
)


def _nats(cluster, coro_fn):
    async def run():
        nc = await nats.connect(cluster.nats_url_for("gateway"))  # what a gateway may read
        try:
            return await coro_fn(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(run())


def published(cluster) -> int:
    """Items ever published to the default pool's work stream (its last sequence number)."""

    async def seq(js):
        return (await js.stream_info(pool_stream_name("default"))).state.last_seq

    return _nats(cluster, seq)


def cache_lookups(url: str) -> dict[str, float]:
    out = {"hit": 0.0, "miss": 0.0}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("sie_gateway_result_cache_lookups_total{"):
            kind = line.split('result="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def encode(url: str, texts: list[str], model: str = FAKE, **headers: str) -> httpx.Response:
    r = httpx.post(
        url + f"/v1/encode/{model}",
        json={"items": [{"text": t} for t in texts], "params": {"output_types": ["dense"]}},
        headers={**MSGPACK, **headers},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def vectors(r: httpx.Response) -> list[np.ndarray]:
    return [np.asarray(item["dense"]["values"]) for item in unpackb(r.content)["items"]]


def test_a_repeated_request_is_answered_from_the_cache_without_publishing(cluster):
    url = cluster.gateway_url
    texts = ["cache me once", "and me too"]
    first = encode(url, texts)
    assert first.headers["X-SIE-Cache-Hits"] == "0"
    seq, before = published(cluster), cache_lookups(url)

    second = encode(url, texts)
    assert second.headers["X-SIE-Cache-Hits"] == "2"
    assert published(cluster) == seq  # nothing went to the work stream
    after = cache_lookups(url)
    assert after["hit"] - before["hit"] == 2 and after["miss"] == before["miss"]
    # the cached answer is the fresh one: same vectors, same bytes per item
    for a, b in zip(vectors(first), vectors(second), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)

    # per item: a request with one new text publishes only that one
    third = encode(url, ["and me too", "a new text"])
    assert third.headers["X-SIE-Cache-Hits"] == "1"
    assert published(cluster) == seq + 1
    assert np.array_equal(vectors(third)[0], vectors(first)[1])

    # the other options are part of the key: a query-flagged encode of the same text is a miss
    r = httpx.post(
        url + f"/v1/encode/{FAKE}",
        json={"items": [{"text": "cache me once"}], "params": {"options": {"is_query": True}}},
        headers=MSGPACK, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200 and r.headers["X-SIE-Cache-Hits"] == "0"
    assert published(cluster) == seq + 2


def test_the_opt_out_header_bypasses_the_cache(cluster):
    url = cluster.gateway_url
    encode(url, ["opt out of me"])
    seq = published(cluster)
    r = encode(url, ["opt out of me"], **{"X-SIE-Cache": "off"})
    assert r.headers["X-SIE-Cache-Hits"] == "0"
    assert published(cluster) == seq + 1
    bad = httpx.post(
        url + f"/v1/encode/{FAKE}",
        json={"items": [{"text": "x"}]},
        headers={"X-SIE-Cache": "maybe"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.headers["X-SIE-Error-Code"] == "INVALID_INPUT", bad.text


def test_a_second_gateway_hits_what_the_first_stored(cluster):
    encode(cluster.gateway_url, ["shared between gateways"])
    other = cluster.spawn_gateway("gw-cache-peer")
    seq = published(cluster)
    r = encode(other, ["shared between gateways"])
    assert r.headers["X-SIE-Cache-Hits"] == "1"
    assert published(cluster) == seq


def test_a_model_config_change_never_serves_an_old_result(cluster):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(cluster.config_url + "/v1/configs/models", content=CACHED_YAML,
                   headers=admin, timeout=30)  # fmt: skip
    assert r.status_code == 201, r.text
    url = cluster.gateway_url
    deadline = time.monotonic() + 60
    while True:  # until the gateway and the worker have the new model
        r = httpx.post(url + f"/v1/encode/{CACHED_MODEL}", json={"items": [{"text": "warm"}]}, timeout=30)
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)
    encode(url, ["config bound"], CACHED_MODEL)
    seq = published(cluster)
    assert encode(url, ["config bound"], CACHED_MODEL).headers["X-SIE-Cache-Hits"] == "1"
    assert published(cluster) == seq

    r = httpx.post(
        cluster.config_url + "/v1/configs/models", content=CACHED_YAML_V2, headers=admin, timeout=30
    )
    assert r.status_code == 201 and r.json()["created_profiles"] == ["second"], r.text
    while "second" not in httpx.get(url + f"/v1/configs/models/{CACHED_MODEL}", timeout=5).text:
        assert time.monotonic() < deadline + 60, "the gateway never saw the new config"
        time.sleep(0.2)
    r = encode(url, ["config bound"], CACHED_MODEL)
    assert r.headers["X-SIE-Cache-Hits"] == "0"
    assert published(cluster) == seq + 1


def test_entries_expire_after_the_ttl(cluster):
    bucket = "SIE_RESULTS_SHORT"
    # long enough that the second request surely comes within it, on a slow host too (1 s once did not)
    url = cluster.spawn_gateway("gw-cache-ttl", SIE_RESULT_CACHE_BUCKET=bucket, SIE_RESULT_CACHE_TTL_S="5")

    async def stored(js):
        return (await js.stream_info(f"KV_{bucket}")).state.messages

    encode(url, ["short lived"])
    assert _nats(cluster, stored) == 1
    seq = published(cluster)
    assert encode(url, ["short lived"]).headers["X-SIE-Cache-Hits"] == "1"
    deadline = time.monotonic() + 30
    while _nats(cluster, stored):  # JetStream drops it once it is older than the bucket's max age
        assert time.monotonic() < deadline, "the entry never expired"
        time.sleep(0.2)
    r = encode(url, ["short lived"])
    assert r.headers["X-SIE-Cache-Hits"] == "0"
    assert published(cluster) == seq + 1


def bulk_delivered(cluster) -> int:
    async def delivered(js):
        info = await js.consumer_info(
            pool_stream_name("default"), lane_durable("default", "cpu", "default", "bulk")
        )
        return info.delivered.stream_seq if info.delivered else 0

    return _nats(cluster, delivered)


def cache_errors(url: str, kind: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("sie_gateway_result_cache_errors_total{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_bucket_is_bounded_and_drops_its_oldest_entries(cluster):
    bucket, bound = "SIE_RESULTS_SMALL", 8192
    url = cluster.spawn_gateway("gw-cache-small", SIE_RESULT_CACHE_BUCKET=bucket,
                                SIE_RESULT_CACHE_MAX_BYTES=str(bound))  # fmt: skip

    async def state(js):
        info = await js.stream_info(f"KV_{bucket}")
        return info.state.bytes, info.config

    texts = [f"bounded entry {i}" for i in range(12)]  # ~1.6 kB each (384 float32 values)
    for t in texts:
        encode(url, [t])
    used, config = _nats(cluster, state)
    assert (
        used <= bound
        and config.max_bytes == bound
        and getattr(config.discard, "value", config.discard) == "old"
    )
    seq = published(cluster)
    assert encode(url, [texts[-1]]).headers["X-SIE-Cache-Hits"] == "1"  # the newest is kept
    assert encode(url, [texts[0]]).headers["X-SIE-Cache-Hits"] == "0"  # the oldest was dropped
    assert published(cluster) == seq + 1


def test_a_result_larger_than_the_value_limit_is_not_cached(cluster):
    url = cluster.spawn_gateway("gw-cache-tiny-values", SIE_RESULT_CACHE_BUCKET="SIE_RESULTS_TINY",
                                SIE_RESULT_CACHE_MAX_VALUE_BYTES="512")  # fmt: skip
    before = cache_errors(url, "too_large")
    encode(url, ["too large to keep"])  # a 384-d float32 vector is 1.5 kB
    assert cache_errors(url, "too_large") == before + 1
    assert encode(url, ["too large to keep"]).headers["X-SIE-Cache-Hits"] == "0"


@pytest.mark.parametrize("how", ["header", "pool", "token"])
def test_bulk_requests_travel_on_the_bulk_durable(cluster, how):
    url = cluster.gateway_url
    headers = {"X-SIE-Cache": "off"}
    if how == "header":
        headers["X-SIE-Priority"] = "bulk"
    elif how == "token":
        url = cluster.spawn_gateway("gw-bulk-token", "bulk-tok", SIE_AUTH_MODE="token",
                                    SIE_AUTH_TOKENS="plain-tok", SIE_AUTH_BULK_TOKENS="bulk-tok")  # fmt: skip
        before = bulk_delivered(cluster)
        encode(url, ["plain token, interactive"], **headers, Authorization="Bearer plain-tok")
        assert bulk_delivered(cluster) == before  # an ordinary token's work is interactive
        headers["Authorization"] = "Bearer bulk-tok"
    else:
        bad = httpx.post(url + "/v1/pools", json={"name": "bad-class", "gpus": {"cpu": 1}, "priority": "urgent"},
                         headers={"Authorization": f"Bearer {POOL_ADMIN}"}, timeout=30)  # fmt: skip
        assert bad.status_code == 400, bad.text
        r = httpx.post(url + "/v1/pools", json={"name": "batch-jobs", "gpus": {"cpu": 1}, "priority": "bulk"},
                       headers={"Authorization": f"Bearer {POOL_ADMIN}"}, timeout=30)  # fmt: skip
        assert r.status_code in (200, 201), r.text
        headers["X-SIE-Pool"] = "batch-jobs"

    before = bulk_delivered(cluster)
    r = encode(url, [f"bulk via {how} {i}" for i in range(3)], **headers)
    assert len(vectors(r)) == 3
    assert bulk_delivered(cluster) > before
    bad = httpx.post(url + f"/v1/encode/{FAKE}", json={"items": [{"text": "x"}]},
                     headers={"X-SIE-Priority": "urgent", "Authorization": "Bearer plain-tok"}, timeout=30)  # fmt: skip
    assert bad.status_code == 400 and "X-SIE-Priority" in bad.text, bad.text


def test_sdks_choose_the_priority_class(cluster, sdk):
    """Our SDK: ``priority=`` per client and per call; the public sie-sdk, which sends no priority
    header of its own (its ``base_url_headers`` need https): a pool whose default class is bulk,
    named in ``gpu="pool/profile"``. (Fresh texts each time: a cache hit would publish nothing.)"""
    from sdk import SIEClient

    with SIEClient(cluster.gateway_url, priority="bulk") as client:
        before = bulk_delivered(cluster)  # (the stream sequence of the last bulk delivery)
        client.encode(FAKE, [{"text": "our sdk, bulk by default 1"}, {"text": "our sdk, bulk by default 2"}])
        after = bulk_delivered(cluster)
        assert after > before
        client.encode(FAKE, {"text": "our sdk, this call interactive"}, priority="interactive")
        assert bulk_delivered(cluster) == after
        with pytest.raises(ValueError, match="priority"):
            client.encode(FAKE, {"text": "x"}, priority="urgent")
    r = httpx.post(cluster.gateway_url + "/v1/pools", json={"name": "sdk-bulk", "gpus": {"cpu": 1}, "priority": "bulk"},
                   headers={"Authorization": f"Bearer {POOL_ADMIN}"}, timeout=30)  # fmt: skip
    assert r.status_code in (200, 201), r.text
    for gpu, text in [("sdk-bulk/cpu", "public sdk, bulk by its pool"), ("cpu", "public sdk, interactive")]:
        before = bulk_delivered(cluster)
        run_sdk(
            f"""
        from sie_sdk import SIEClient
        with SIEClient(URL) as c:
            c.encode({FAKE!r}, {{"text": {text!r}}}, gpu={gpu!r})
        print("{{}}")
        """,
            cluster.gateway_url,
        )
        assert (bulk_delivered(cluster) > before) is (gpu == "sdk-bulk/cpu"), gpu


def test_the_public_sdk_gets_the_same_vectors_from_the_cache(cluster, sdk):
    script = f"""
    from sie_sdk import SIEClient
    with SIEClient(URL) as c:
        r = c.encode({FAKE!r}, {{"text": "asked twice through the public sdk"}}, gpu="cpu",
                     options={{"is_query": True}})
    print(json.dumps(r["dense"].tolist()))
    """
    first = run_sdk(script, cluster.gateway_url)
    seq, before = published(cluster), cache_lookups(cluster.gateway_url)
    second = run_sdk(script, cluster.gateway_url)
    assert second == first
    assert published(cluster) == seq
    assert cache_lookups(cluster.gateway_url)["hit"] == before["hit"] + 1
