"""The three OpenAPI documents are valid OpenAPI 3.1 and are generated from the request models:
a model's fields are the document's, so a field added to a parser shows up without a hand edit."""

from __future__ import annotations

import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from config_service import docs as config_docs
from gateway.routes import docs as gateway_docs
from iokit import openapi
from protocol.api import EncodeRequest, PoolBody, ScoreRequest
from protocol.config_delta import ResolveBody
from protocol.model_config import ModelConfig
from protocol.openai import EmbeddingsBody
from protocol.rerank import CohereRerankRequest, TeiRerankRequest
from worker.serve import docs as serve_docs

BUILDERS = {"gateway": gateway_docs.build, "serve": serve_docs.build, "config": config_docs.build}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_document_is_valid_openapi_3_1(name):
    doc = BUILDERS[name]()
    assert doc["openapi"] == "3.1.0"
    validate(doc, cls=OpenAPIV31SpecValidator)
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    ("name", "path", "model"),
    [
        ("gateway", "/v1/encode/{model}", EncodeRequest),
        ("gateway", "/v1/score/{model}", ScoreRequest),
        ("gateway", "/v1/embeddings", EmbeddingsBody),
        ("gateway", "/v1/rerank", CohereRerankRequest),
        ("gateway", "/rerank", TeiRerankRequest),
        ("gateway", "/v1/pools", PoolBody),
        ("serve", "/v2/rerank", CohereRerankRequest),
        ("serve", "/v1/encode/{model}", EncodeRequest),
        ("config", "/v1/configs/models", ModelConfig),
        ("config", "/v1/configs/resolve", ResolveBody),
    ],
)
def test_request_bodies_are_the_parsers_models(name, path, model):
    doc = BUILDERS[name]()
    body = doc["paths"][path]["post"]["requestBody"]["content"]
    ref = next(iter(body.values()))["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(schema["properties"]) == set(model.model_fields), ref


def test_routes_of_the_apps_are_documented():
    """Every HTTP route of ``sie serve`` is in its document (WebSockets aside)."""
    from worker.serve.app import create_app

    class _Runtime:  # only the route table is read; the app is never started
        settings = None

    from worker.settings import WorkerSettings

    app = create_app(_Runtime(), WorkerSettings())  # type: ignore[arg-type]
    doc = serve_docs.build()
    routes = set()
    for route in app.router.routes():
        if route.method in ("HEAD", "*"):
            continue
        path = route.resource.canonical if route.resource else ""
        path = path.replace("{model:.+}", "{model}")
        if path.startswith("/ws/") or path == "/docs/assets/{name}":
            continue
        routes.add((route.method.lower(), path))
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes - documented == set()


def test_docs_page_uses_only_bundled_assets():
    folder = openapi.assets_dir()
    assert folder is not None, "swagger-ui-bundle-v2 is not installed"
    for name in openapi.ASSETS:
        assert (folder / name).stat().st_size > 100
    page = openapi.docs_page("x <y>")
    assert "http" not in page and "x &lt;y&gt;" in page
