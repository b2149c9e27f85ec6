"""Schemathesis against the gateway of a real cluster (NATS, config service, sidecar, worker with
``sie-fake``), from the gateway's own ``/openapi.json``: no 5xx, no hang, answers as documented."""

from __future__ import annotations

import pytest

from tests.integration.cluster.conftest import FAKE, POOL_ADMIN
from tests.support.schema_fuzz import fuzz_service

PATHS = {"model": [FAKE], "name": ["default"]}
ADMIN = {"Authorization": f"Bearer {POOL_ADMIN}"}  # reaches the pool routes past their admin check


def test_schemathesis_bounded(cluster):
    statuses = fuzz_service(cluster.gateway_url, max_examples=8, headers=ADMIN, path_values=PATHS)
    print("gateway schemathesis:", dict(statuses))
    for route in ("/v1/encode/{model}", "/v1/score/{model}", "/v2/rerank", "/rerank", "/v1/embeddings"):
        assert statuses[f"POST {route} 200"] >= 1, statuses  # the documented examples are answered


@pytest.mark.slow
def test_schemathesis_long(cluster):
    fuzz_service(cluster.gateway_url, max_examples=150, headers=ADMIN, path_values=PATHS)
