"""Cohere's and TEI's rerank routes on ``sie serve``, with the real ``cohere`` client, against the
native score route of the same server (the deterministic ``sie-fake`` scorer)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("cohere")

from tests.support import rerank_checks  # noqa: E402
from tests.support.serve import ServeProcess  # noqa: E402

FAKE = "sie-fake"
LIMIT = 8


@pytest.fixture(scope="module")
def server():
    env = {"SIE_PRELOAD_MODELS": FAKE, "SIE_MAX_SCORE_ITEMS": str(LIMIT), "SIE_RERANK_DEFAULT_MODEL": FAKE}
    with ServeProcess(env=env) as srv:
        yield srv


def test_cohere_clients_give_the_score_routes_ranking(server):
    rerank_checks.check_cohere_clients(server.url, FAKE)


def test_cohere_errors(server):
    rerank_checks.check_cohere_errors(server.url, FAKE)


def test_tei_rerank(server):
    rerank_checks.check_tei(server.url, FAKE)
    # no model in the body: the server's default rerank model
    resp = httpx.post(f"{server.url}/rerank", json={"query": "q", "texts": ["a", "b"]}, timeout=60)
    assert resp.status_code == 200 and sorted(r["index"] for r in resp.json()) == [0, 1]


def test_document_limit_is_the_score_limit(server):
    rerank_checks.check_limit(server.url, FAKE, LIMIT)


def test_body_limit(server):
    big = "x" * (35 * 1024 * 1024)
    resp = httpx.post(
        f"{server.url}/v1/rerank", json={"model": FAKE, "query": big, "documents": ["a"]}, timeout=60
    )
    assert resp.status_code == 413
