"""A pool's ``pinned_models`` through a real cluster: the gateway tells the workers assigned to the
pool (``sie.pin.<worker>``), the sidecar passes it on in its Pings, the worker loads the models and
keeps them — the idle unload (``SIE_MODEL_IDLE_TIMEOUT_S``) takes the unpinned model and leaves the
pinned one; once the pool is deleted, the formerly pinned model goes idle like any other."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from tests.integration.cluster.conftest import FAKE, POOL_ADMIN, TestCluster
from tests.support.cluster import free_cluster_ports, running
from tests.support.polling import wait_until

PINNED = "sie-fake:slow-batch"
ADMIN_HEADERS = {"Authorization": f"Bearer {POOL_ADMIN}"}  # pool writes need the gateway's admin token


class IdleCluster(TestCluster):
    """The test cluster whose worker unloads a model idle for 2 s, pins every half second."""

    settings: ClassVar[dict[str, str]] = {
        **TestCluster.settings,
        "SIE_MODEL_IDLE_TIMEOUT_S": "2",
        "SIE_MODEL_LOADING_RETRY_AFTER_S": "1",
        "SIE_POOL_PIN_INTERVAL_S": "0.5",
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = Path(tmp_path_factory.mktemp("pinned"))
    with running(IdleCluster(state_dir=state, **free_cluster_ports(), preload=FAKE)) as c:
        yield c


def _loaded(url: str, spec: str) -> bool:
    return bool(httpx.get(f"{url}/v1/models/{spec}", timeout=10).json().get("loaded"))


def _pinned_on_workers(url: str) -> list[list[str]]:
    return [w.get("pinned_models", []) for w in httpx.get(url + "/health", timeout=10).json()["workers"]]


def _wait(predicate, what: str) -> None:
    asyncio.run(wait_until(predicate, 90, interval_s=0.2, what=what))


def test_pool_pinned_model_is_loaded_and_never_idle_unloaded(cluster):
    url = cluster.gateway_url
    resp = httpx.post(
        url + "/v1/pools",
        json={"name": "keep", "gpus": {"cpu": 1}, "pinned_models": [PINNED]},
        timeout=10,
        headers=ADMIN_HEADERS,
    )
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["pinned_models"] == [PINNED]
    _wait(lambda: _loaded(url, PINNED), "the pool's pinned model loaded on its worker")
    assert [FAKE] in _pinned_on_workers(url)

    # the unpinned default profile serves a request, then goes idle and is unloaded ...
    resp = httpx.post(url + f"/v1/encode/{FAKE}", json={"items": [{"text": "hi"}]}, timeout=60)
    while resp.status_code == 503:  # loading after an earlier idle unload
        _wait(lambda: _loaded(url, FAKE), "sie-fake loaded again")
        resp = httpx.post(url + f"/v1/encode/{FAKE}", json={"items": [{"text": "hi"}]}, timeout=60)
    assert resp.status_code == 200, resp.text
    _wait(lambda: not _loaded(url, FAKE), "the unpinned model unloaded when idle")
    # ... while the pinned one, idle just as long, stays
    assert _loaded(url, PINNED)

    # without the pool nothing pins it: it goes the way of any idle model
    assert httpx.delete(url + "/v1/pools/keep", headers=ADMIN_HEADERS, timeout=10).status_code == 200
    _wait(lambda: [] in _pinned_on_workers(url) and [FAKE] not in _pinned_on_workers(url), "pin lifted")
    _wait(lambda: not _loaded(url, PINNED), "the formerly pinned model unloaded when idle")
