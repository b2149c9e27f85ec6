"""The gateway's OpenAPI document (``/openapi.json``) and docs page (``/docs``): its operations,
each with the model its handler parses (``iokit/openapi.py`` builds the document)."""

from __future__ import annotations

from typing import Any

from iokit import openapi
from iokit.openapi import JSON, YAML, Op, Param
from protocol.api import BatchBody, FileUpload, PoolBody
from protocol.config_delta import EpochInfo

TITLE = "sie-cluster gateway"
DESCRIPTION = (
    "The cluster's HTTP edge: the SIE inference routes (msgpack or JSON), OpenAI-, Cohere- and "
    "TEI-compatible routes, pools, and read-only mirrors of the config service. Pool writes "
    "(create, renew, delete) need the gateway's admin token (SIE_ADMIN_TOKEN) in every auth mode: "
    "403 FORBIDDEN while none is configured."
)
POOL = Param("name", "The pool name (case-insensitive).")
CONFIG_MODEL = Param("model_id", "The model id.")
OBJECT: dict[str, Any] = {"type": "object"}
FILE = Param("file_id", "A file id (file-...).")
BATCH = Param("batch_id", "A batch id (batch_...).")
MULTIPART = "multipart/form-data"
OCTETS = "application/octet-stream"


def operations() -> list[Op]:
    pools, cfg, ops, batch = "pools", "config", "operations", "batch"
    return [
        *openapi.inference_ops(),
        Op("GET", "/", "What this server is", ops, response_schema=OBJECT),
        Op("GET", "/health", "The cluster as this gateway sees it", ops, response_schema=OBJECT),
        *openapi.probe_ops(),
        Op("POST", "/v1/pools", "Create or update a pool (a lease)", pools, PoolBody, response_schema=OBJECT,
           statuses=(201,)),
        Op("GET", "/v1/pools", "List pools", pools, response_schema=OBJECT),
        Op("GET", "/v1/pools/{name}", "One pool", pools, response_schema=OBJECT, params=(POOL,)),
        Op("POST", "/v1/pools/{name}/renew", "Renew a pool's lease", pools, response_schema=OBJECT,
           params=(POOL,)),
        Op("DELETE", "/v1/pools/{name}", "Delete a pool", pools, response_schema=OBJECT, params=(POOL,)),
        Op("GET", "/v1/configs/models", "Configured models (mirror)", cfg, response_schema=OBJECT),
        Op("GET", "/v1/configs/models/{model_id}", "A model's YAML (mirror)", cfg, response_types=(YAML,),
           params=(CONFIG_MODEL,)),
        Op("GET", "/v1/configs/bundles", "Bundles (mirror)", cfg, response_schema=OBJECT),
        Op("GET", "/v1/configs/epoch", "The config epoch (mirror)", cfg, response=EpochInfo),
        Op("POST", "/v1/files", "Upload a batch input file (OpenAI)", batch, FileUpload, body_types=(MULTIPART,),
           response_schema=OBJECT, errors="openai"),
        Op("GET", "/v1/files", "List files (OpenAI)", batch, response_schema=OBJECT, errors="openai"),
        Op("GET", "/v1/files/{file_id}", "A file (OpenAI)", batch, response_schema=OBJECT, errors="openai",
           params=(FILE,)),
        Op("GET", "/v1/files/{file_id}/content", "A file's content", batch, response_types=(OCTETS,),
           response_schema={"type": "string", "format": "binary"}, errors="openai", params=(FILE,)),
        Op("DELETE", "/v1/files/{file_id}", "Delete a file (OpenAI)", batch, response_schema=OBJECT,
           errors="openai", params=(FILE,)),
        Op("POST", "/v1/batches", "Create a batch (OpenAI)", batch, BatchBody, response_schema=OBJECT,
           errors="openai"),
        Op("GET", "/v1/batches", "List batches (OpenAI)", batch, response_schema=OBJECT, errors="openai"),
        Op("GET", "/v1/batches/{batch_id}", "A batch (OpenAI)", batch, response_schema=OBJECT, errors="openai",
           params=(BATCH,)),
        Op("POST", "/v1/batches/{batch_id}/cancel", "Cancel a batch (OpenAI)", batch, response_schema=OBJECT,
           errors="openai", params=(BATCH,), body_required=False),
        *openapi.doc_ops(),
    ]  # fmt: skip


def build() -> dict[str, Any]:
    return openapi.document(TITLE, DESCRIPTION, operations(), security=True)


__all__ = ["JSON", "build", "operations"]
