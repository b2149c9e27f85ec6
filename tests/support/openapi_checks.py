"""Checks of a service's ``/openapi.json`` and ``/docs`` over real HTTP: the document validates as
OpenAPI 3.1, and the docs page loads every asset from the same server (nothing from a network)."""

from __future__ import annotations

import re

import httpx
from openapi_spec_validator import OpenAPIV31SpecValidator, validate


def check_document_and_docs(url: str, headers: dict[str, str] | None = None) -> dict:
    with httpx.Client(base_url=url, timeout=30, headers=headers or {}) as client:
        resp = client.get("/openapi.json")
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        doc = resp.json()
        assert doc["openapi"] == "3.1.0"
        validate(doc, cls=OpenAPIV31SpecValidator)
        page = client.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "http://" not in page.text and "https://" not in page.text  # no CDN, no other host
        links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert len(links) >= 3, links
        for link in links:
            assert link.startswith("/docs/assets/"), link
            asset = client.get(link)
            assert asset.status_code == 200 and len(asset.content) > 100, link
        assert "/openapi.json" in page.text
        assert client.get("/docs/assets/nothere.js").status_code == 404
    return doc
