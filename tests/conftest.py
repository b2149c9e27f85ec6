from __future__ import annotations

import pytest

from tests.support.nats_server import NatsServer

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


@pytest.fixture
def nats_server():
    """A fresh nats-server with JetStream for one test; can be stopped and restarted."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()
