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
