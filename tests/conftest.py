from __future__ import annotations

import os
import threading

import pytest

from tests.support.nats_server import NatsServer
from tests.support.sdk312 import sdk_unavailable

# The files that take longest, slowest first (seconds of one worker in a `make test` on 2 cores,
# 5 workers, 2026-11-26; 2,034 s in all): with `pytest -n` they start at once on their own workers
# instead of being handed out last and leaving the run waiting on one worker (the five-minute soak
# handed out late made the run 570 s instead of about 480). Every other file keeps its place after
# them.
SLOW_FIRST = [
    "tests/integration/cluster/test_soak.py",  # 315
    "tests/integration/cluster/test_long_inputs.py",  # 85
    "tests/integration/cluster/test_sdk_contract_cluster.py",  # 85
    "tests/integration/families/test_quickstart_gateway.py",  # 81
    "tests/integration/families/test_families_sdk.py",  # 64
    "tests/integration/cluster/test_result_cache.py",  # 60
    "tests/integration/worker/test_idle_and_pinned.py",  # 56
    "tests/integration/lifecycle/test_memory_runtime.py",  # 55
    "tests/integration/cluster/test_sie_up.py",  # 48
    "tests/integration/sidecar/test_failures.py",  # 46
    "tests/integration/families/test_images_public_sdk.py",  # 46
    "tests/integration/worker/test_batching_runtime.py",  # 42
    "tests/integration/cluster/test_live_model_add.py",  # 41
    "tests/integration/worker/test_errors.py",  # 41
    "tests/integration/config_service/test_config_service.py",  # 37
    "tests/unit/families/test_decoder_families.py",  # 34
    "tests/integration/cluster/test_sie_up_faults.py",  # 34
    "tests/integration/cluster/test_sie_up_batch.py",  # 34
    "tests/integration/lifecycle/test_sdk_checks_16_18.py",  # 33
    "tests/integration/cluster/test_pinned_pool.py",  # 31
]


@pytest.fixture(scope="session")
def sdk():
    """Skips the test where the public sie-sdk cannot run here (tests.support.sdk312)."""
    reason = sdk_unavailable()
    if reason:
        pytest.skip(reason)


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
