"""``sie serve``'s OpenAPI document (``/openapi.json``) and docs page (``/docs``): its operations,
each with the model its handler parses (``iokit/openapi.py`` builds the document)."""

from __future__ import annotations

from typing import Any

from iokit import openapi
from iokit.openapi import Op

TITLE = "sie serve"
DESCRIPTION = (
    "The standalone worker: the SIE inference routes (msgpack or JSON), and the OpenAI-, Cohere- "
    "and TEI-compatible routes, served from this process's models. Started with `--api-key` "
    "(SIE_API_KEY), every route but the probes and these docs needs `Authorization: Bearer <key>`."
)
OBJECT: dict[str, Any] = {"type": "object"}


def operations() -> list[Op]:
    ops = "operations"
    return [
        *openapi.inference_ops(),
        Op("GET", "/", "What this server is", ops, response_schema=OBJECT),
        Op("GET", "/health", "This worker's state", ops, response_schema=OBJECT),
        *openapi.probe_ops(),
        Op("GET", "/livez", "Liveness", ops, response_types=(openapi.TEXT,)),
        *openapi.doc_ops(),
    ]


def build() -> dict[str, Any]:
    return openapi.document(TITLE, DESCRIPTION, operations(), security=True)
