"""The config service's OpenAPI document (``/openapi.json``) and docs page (``/docs``): its
operations, each with the model its handler parses (``iokit/openapi.py`` builds the document)."""

from __future__ import annotations

from typing import Any

from iokit import openapi
from iokit.openapi import JSON, YAML, Op, Param
from protocol.config_delta import ConfigExport, EpochInfo, ResolveBody
from protocol.model_config import ModelConfig

TITLE = "sie-cluster config service"
DESCRIPTION = (
    "The control plane: model configs (YAML or JSON bodies, append-only POST, wholesale PUT), "
    "bundles, the config epoch and a consistent export. Writes need the admin token."
)
MODEL_ID = Param("model_id", "The model id (`org/name`; slashes are kept).")
OBJECT: dict[str, Any] = {"type": "object"}


def operations() -> list[Op]:
    models, ops = "models", "operations"
    return [
        Op("POST", "/v1/configs/models", "Add a model, or append profiles", models, ModelConfig, (YAML, JSON),
           response_schema=OBJECT, statuses=(200, 201), errors="config",
           description="Partial bodies are allowed (a body may only add profiles); unknown keys are refused."),
        Op("GET", "/v1/configs/models", "Configured models", models, response_schema=OBJECT, errors="config"),
        Op("GET", "/v1/configs/models/{model_id}", "A model's stored YAML", models, response_types=(YAML,),
           params=(MODEL_ID,), errors="config"),
        Op("PUT", "/v1/configs/models/{model_id}", "Replace a model's config", models, ModelConfig, (YAML, JSON),
           response_schema=OBJECT, params=(MODEL_ID,), errors="config"),
        Op("DELETE", "/v1/configs/models/{model_id}", "Remove an API-added config", models,
           response_schema=OBJECT, params=(MODEL_ID,), errors="config"),
        Op("GET", "/v1/configs/export", "A consistent snapshot of every model", "export", response=ConfigExport,
           errors="config"),
        Op("GET", "/v1/configs/epoch", "The config epoch and hashes", "export", response=EpochInfo,
           errors="config"),
        Op("GET", "/v1/configs/bundles", "Bundles", "bundles", response_schema=OBJECT, errors="config"),
        Op("GET", "/v1/configs/bundles/{bundle_id}", "One bundle (YAML, or JSON with ?format=json)", "bundles",
           response_types=(YAML, JSON), params=(Param("bundle_id", "The bundle name."),), errors="config"),
        Op("POST", "/v1/configs/resolve", "Which bundle serves a model", models, ResolveBody,
           response_schema=OBJECT, errors="config"),
        Op("GET", "/healthz", "Liveness", ops, response_schema=OBJECT, errors="config"),
        Op("GET", "/readyz", "Readiness", ops, response_schema=OBJECT, statuses=(200, 503), errors="config"),
        Op("GET", "/metrics", "Prometheus metrics", ops, response_types=(openapi.TEXT,), errors="config"),
        *openapi.doc_ops(),
    ]  # fmt: skip


def build() -> dict[str, Any]:
    return openapi.document(TITLE, DESCRIPTION, operations(), security=True)
