from __future__ import annotations

import os
import threading

import pytest

from tests.support.nats_server import NatsServer
from tests.support.sdk312 import sdk_unavailable

# The files that take longest (seconds of one worker, measured on a 2-core machine under
# `make test`), run first: with `pytest -n` they start at once on their own workers instead of
# being handed out last and leaving the run waiting on one worker. Every other file keeps its place.
SLOW_FIRST = [
    "tests/integration/families/test_families_sdk.py",
    "tests/integration/families/test_quickstart_gateway.py",
    "tests/integration/families/test_images_public_sdk.py",
    "tests/integration/cluster/test_long_inputs.py",
    "tests/integration/cluster/test_sdk_contract_cluster.py",
    "tests/integration/cluster/test_result_cache.py",
    "tests/integration/cluster/test_live_model_add.py",
    "tests/integration/cluster/test_sie_up.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    # The public SDK's venv takes minutes to build (pip downloads): one process starts it at once,
    # in the background, so that the tests needing it build their models meanwhile instead of
    # waiting for it first (sdk_unavailable() waits on the build's lock).
    first = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if first and any(item.get_closest_marker("sdk312") or "sdk" in item.fixturenames for item in items):
        threading.Thread(target=sdk_unavailable, name="sdk312-venv", daemon=True).start()


@pytest.fixture
def nats_server():
    """A fresh nats-server with JetStream for one test; can be stopped and restarted."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()
