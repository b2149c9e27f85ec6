"""The gateway's ``/openapi.json`` validates and ``/docs`` loads with its assets from the gateway,
also with auth on (the API's description is open, like the probes)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.openapi_checks import check_document_and_docs

pytestmark = pytest.mark.asyncio


async def test_document_and_docs_page(start_gateway):
    h = await start_gateway(auth_mode="token", auth_tokens=["t0k"])
    url = h.url("/").rstrip("/")
    doc = await asyncio.to_thread(check_document_and_docs, url)
    assert {"/v1/rerank", "/v2/rerank", "/rerank", "/v1/pools", "/v1/encode/{model}"} <= set(doc["paths"])
    async with httpx.AsyncClient() as client:  # the API itself still wants a token
        resp = await client.post(url + "/v1/rerank", json={"model": "m", "query": "q", "documents": ["a"]})
    assert resp.status_code == 401
