"""``sie serve``'s ``/openapi.json`` validates and ``/docs`` loads with its assets from the server."""

from __future__ import annotations

import pytest

from tests.support.openapi_checks import check_document_and_docs
from tests.support.serve import ServeProcess


@pytest.fixture(scope="module")
def server():
    with ServeProcess(env={"SIE_PRELOAD_MODELS": "sie-fake"}) as srv:
        yield srv


def test_document_and_docs_page(server):
    doc = check_document_and_docs(server.url)
    assert {"/v1/rerank", "/v2/rerank", "/rerank", "/v1/embeddings"} <= set(doc["paths"])


def test_schemathesis_bounded(server):
    from tests.support.schema_fuzz import fuzz_service

    statuses = fuzz_service(server.url, max_examples=8, path_values={"model": ["sie-fake"]})
    print("sie serve schemathesis:", dict(statuses))
    for route in ("/v1/encode/{model}", "/v1/score/{model}", "/v1/rerank", "/rerank", "/v1/embeddings"):
        assert statuses[f"POST {route} 200"] >= 1, statuses  # the documented examples are answered


@pytest.mark.slow
def test_schemathesis_long(server):
    from tests.support.schema_fuzz import fuzz_service

    fuzz_service(server.url, max_examples=200, path_values={"model": ["sie-fake"]})
