"""OpenAPI 3.1 documents of the three HTTP services, generated from the models that parse their
requests, and the offline docs page that renders them.

Each service lists its operations (:class:`Op`): method, path, and the pydantic model its handler
parses the body with (``protocol.api``, ``protocol.rerank``, ``protocol.openai``,
``protocol.model_config``, ...), plus the model of the answer where one exists. :func:`document`
turns the list into the document: the models' JSON Schemas (2020-12, which OpenAPI 3.1 uses) go
under ``components.schemas``, every operation answers errors in its route's envelope. Nothing in
the document is written by hand apart from the summaries, so a field added to a request model
shows up in ``/openapi.json`` at once.

``/docs`` is Swagger UI from the ``swagger-ui-bundle-v2`` package, served by the service itself
(no CDN): :func:`add_routes` wires ``/openapi.json``, ``/docs`` and ``/docs/assets/{name}``.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from protocol import SERVER_VERSION

JSON = "application/json"
MSGPACK = "application/msgpack"
YAML = "application/x-yaml"
TEXT = "text/plain"
ErrorStyle = Literal["native", "openai", "tei", "config"]
DOC_PATHS = ("/openapi.json", "/docs", "/docs/assets/{name}")


class ErrorObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str | None = None
    message: str
    param: str | None = None


class NativeError(BaseModel):
    """The native error envelope: ``{"detail": {code, message, param?, ...}}``."""

    detail: ErrorObject | str


class OpenAIErrorObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """The OpenAI error envelope (``/v1/embeddings`` and Cohere's rerank routes)."""

    error: OpenAIErrorObject


class TeiError(BaseModel):
    """Text Embeddings Inference's error shape (its ``/rerank`` route)."""

    model_config = ConfigDict(extra="allow")

    error: str
    error_type: Literal["Validation", "Overloaded", "Unhealthy", "Backend"]
    code: str | None = None
    param: str | None = None


class ConfigErrorObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    error: str
    message: str | None = None


class ConfigErrorBody(BaseModel):
    """The config service's error envelope: ``{"detail": {"error": ..., "message": ...}}`` or a string."""

    detail: ConfigErrorObject | str | list[Any]


ERRORS: dict[ErrorStyle, type[BaseModel]] = {
    "native": NativeError,
    "openai": OpenAIError,
    "tei": TeiError,
    "config": ConfigErrorBody,
}


@dataclass(frozen=True)
class Param:
    name: str
    description: str
    where: Literal["path", "query", "header"] = "path"
    required: bool = True
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string", "minLength": 1})


@dataclass(frozen=True)
class Op:
    """One operation: what its handler parses, and what it answers."""

    method: str
    path: str
    summary: str
    tag: str
    body: type[BaseModel] | None = None
    body_types: tuple[str, ...] = (JSON,)
    body_required: bool = True
    response: type[BaseModel] | None = None
    response_schema: dict[str, Any] | None = None  # an answer without a model (a list, text)
    response_types: tuple[str, ...] = (JSON,)
    statuses: tuple[int, ...] = (200,)
    errors: ErrorStyle = "native"
    params: tuple[Param, ...] = ()
    description: str = ""


MODEL_PARAM = Param("model", "The model id (`org/name`, or `org/name:profile`); slashes are kept.")


def _operation_id(op: Op) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in op.path).strip("_")
    return f"{op.method.lower()}_{cleaned or 'root'}"


def document(title: str, description: str, ops: list[Op], *, security: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``ops``."""
    wanted: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = []
    for op in ops:
        if op.body is not None:
            wanted.append((op.body, "validation"))
        if op.response is not None:
            wanted.append((op.response, "serialization"))
        wanted.append((ERRORS[op.errors], "serialization"))
    unique = list(dict.fromkeys(wanted))
    refs, defs = models_json_schema(unique, ref_template="#/components/schemas/{model}")
    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        entry: dict[str, Any] = {
            "operationId": _operation_id(op),
            "summary": op.summary,
            "tags": [op.tag],
        }
        if op.description:
            entry["description"] = op.description
        if op.params:
            entry["parameters"] = [
                {
                    "name": p.name,
                    "in": p.where,
                    "required": p.required,
                    "description": p.description,
                    "schema": p.schema,
                }
                for p in op.params
            ]
        if op.body is not None:
            schema = refs[(op.body, "validation")]
            entry["requestBody"] = {
                "required": op.body_required,
                "content": {ct: {"schema": schema} for ct in op.body_types},
            }
        ok_schema = refs[(op.response, "serialization")] if op.response is not None else op.response_schema
        responses: dict[str, Any] = {}
        for status in op.statuses:
            content = {
                ct: ({"schema": ok_schema} if ok_schema is not None else {}) for ct in op.response_types
            }
            responses[str(status)] = {"description": "Success", "content": content}
        error_ref = refs[(ERRORS[op.errors], "serialization")]
        responses["default"] = {"description": "Error", "content": {JSON: {"schema": error_ref}}}
        entry["responses"] = responses
        if security:
            entry["security"] = [{}, {"bearer": []}]
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": SERVER_VERSION, "description": description},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
    if security:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


# ---- the docs page -------------------------------------------------------------------------------

ASSETS = ("swagger-ui.css", "swagger-ui-bundle.js", "index.css")


def assets_dir() -> Path | None:
    """Where the bundled Swagger UI files are (``swagger-ui-bundle-v2``), or None if not installed."""
    spec = importlib.util.find_spec("swagger_ui_bundle")
    if spec is None or not spec.submodule_search_locations:
        return None
    vendor = Path(next(iter(spec.submodule_search_locations))) / "vendor"
    found = sorted(vendor.glob("swagger-ui-*/swagger-ui-bundle.js"))
    return found[-1].parent if found else None


def docs_page(title: str) -> str:
    """The HTML of ``/docs``: Swagger UI over ``/openapi.json``, every asset from this server."""
    safe = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{safe} — API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="stylesheet" href="/docs/assets/index.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true}});
</script>
</body>
</html>
"""


def add_routes(app: web.Application, title: str, build: Any) -> None:
    """``/openapi.json`` (``build()``'s document, made once), ``/docs`` and its assets."""
    cache: dict[str, bytes] = {}

    async def openapi_json(request: web.Request) -> web.Response:
        if "doc" not in cache:
            cache["doc"] = json.dumps(build()).encode()
        return web.Response(body=cache["doc"], content_type=JSON)

    async def docs(request: web.Request) -> web.Response:
        return web.Response(text=docs_page(title), content_type="text/html")

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        folder = assets_dir()
        if name not in ASSETS or folder is None:
            raise web.HTTPNotFound()
        content_type = "text/css" if name.endswith(".css") else "application/javascript"
        return web.Response(body=(folder / name).read_bytes(), content_type=content_type)

    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/docs", docs)
    app.router.add_get("/docs/assets/{name}", asset)


def doc_ops(tag: str = "docs") -> list[Op]:
    """The document's own routes, for the operation lists."""
    return [
        Op("GET", "/openapi.json", "This OpenAPI document", tag, response_schema={"type": "object"}),
        Op(
            "GET",
            "/docs",
            "The API docs page (Swagger UI, served offline)",
            tag,
            response_types=("text/html",),
        ),
    ]


def inference_ops() -> list[Op]:
    """The inference routes that the gateway and ``sie serve`` both answer."""
    from protocol import openai, rerank
    from protocol.api import (
        EncodeRequest,
        ExtractRequest,
        ItemsResponse,
        ModelEntry,
        ModelsResponse,
        ScoreRequest,
        ScoreResponse,
        TokenizeRequest,
    )

    native = (JSON, MSGPACK)
    tag = "inference"
    return [
        Op("POST", "/v1/encode/{model}", "Encode items (dense, sparse, multivector)", tag, EncodeRequest,
           native, response=ItemsResponse, response_types=native, params=(MODEL_PARAM,)),
        Op("POST", "/v1/score/{model}", "Score items against a query (rerank)", tag, ScoreRequest, native,
           response=ScoreResponse, response_types=native, params=(MODEL_PARAM,)),
        Op("POST", "/v1/extract/{model}", "Extract entities, relations, classes", tag, ExtractRequest, native,
           response=ItemsResponse, response_types=native, params=(MODEL_PARAM,)),
        Op("POST", "/v1/tokenize/{model}", "The model's own tokens of each item", tag, TokenizeRequest, native,
           response=ItemsResponse, response_types=native, params=(MODEL_PARAM,)),
        Op("POST", "/v1/embeddings", "OpenAI-compatible embeddings", "compatible", openai.EmbeddingsBody,
           response=openai.EmbeddingsResponse, errors="openai"),
        Op("POST", "/v1/rerank", "Cohere-compatible rerank (v1)", "compatible", rerank.CohereRerankRequest,
           response=rerank.CohereRerankResponse, errors="openai"),
        Op("POST", "/v2/rerank", "Cohere-compatible rerank (v2)", "compatible", rerank.CohereRerankRequest,
           response=rerank.CohereRerankResponse, errors="openai"),
        Op("POST", "/rerank", "Text Embeddings Inference-compatible rerank", "compatible",
           rerank.TeiRerankRequest, response=rerank.TeiRerankResponse, errors="tei"),
        Op("GET", "/v1/models", "The models this server can route", "models", response=ModelsResponse),
        Op("GET", "/v1/models/{model}", "One model", "models", response=ModelEntry, params=(MODEL_PARAM,)),
    ]  # fmt: skip


def probe_ops(tag: str = "operations") -> list[Op]:
    """``/healthz``, ``/readyz`` and ``/metrics`` (text answers)."""
    text = (TEXT, JSON)
    return [
        Op("GET", "/healthz", "Liveness", tag, response_types=text),
        Op(
            "GET",
            "/readyz",
            "Readiness (503 while starting or draining)",
            tag,
            response_types=text,
            statuses=(200, 503),
        ),
        Op("GET", "/metrics", "Prometheus metrics", tag, response_types=(TEXT,)),
    ]
