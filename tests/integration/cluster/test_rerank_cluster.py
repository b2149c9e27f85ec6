"""Cohere's and TEI's rerank routes through the gateway (real cluster: NATS, config service,
sidecar, worker), with the real ``cohere`` client, against the gateway's own score route."""

from __future__ import annotations

import pytest

pytest.importorskip("cohere")

from tests.integration.cluster.conftest import FAKE  # noqa: E402
from tests.support import rerank_checks  # noqa: E402


def test_cohere_clients_through_the_gateway(cluster):
    rerank_checks.check_cohere_clients(cluster.gateway_url, FAKE)
    rerank_checks.check_cohere_errors(cluster.gateway_url, FAKE)


def test_tei_and_limits_through_a_gateway(cluster):
    url = cluster.spawn_gateway(
        "gw-rerank", SIE_GATEWAY_MAX_SCORE_ITEMS="8", SIE_GATEWAY_RERANK_DEFAULT_MODEL=FAKE
    )
    rerank_checks.check_tei(url, FAKE)
    rerank_checks.check_limit(url, FAKE, 8)
