"""The read-side config API: a mirror of the config service's reads; writes are refused."""

from __future__ import annotations

from aiohttp import web

from gateway.parts import REGISTRY_KEY
from iokit import http


async def handle_config_models(request: web.Request) -> web.Response:
    return web.json_response(request.app[REGISTRY_KEY].config_models())


async def handle_config_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    text = request.app[REGISTRY_KEY].config_model_yaml(model_id)
    if text is None:
        return http.config_error_response(
            404, "model_not_found", f"model {model_id!r} is not configured", model_id=model_id
        )
    return web.Response(text=text, content_type="application/x-yaml")


async def handle_config_bundles(request: web.Request) -> web.Response:
    return web.json_response(request.app[REGISTRY_KEY].config_bundles())


async def handle_config_bundle(request: web.Request) -> web.Response:
    import yaml

    bundle_id = request.match_info["bundle_id"]
    doc = request.app[REGISTRY_KEY].config_bundle(bundle_id)
    if doc is None:
        return http.config_error_response(
            404, "bundle_not_found", f"bundle {bundle_id!r} is not known", bundle_id=bundle_id
        )
    if request.query.get("format") == "json" or "application/json" in request.headers.get("Accept", ""):
        return web.json_response(doc)
    return web.Response(text=yaml.safe_dump(doc, sort_keys=False), content_type="application/x-yaml")


async def handle_config_epoch(request: web.Request) -> web.Response:
    return web.json_response(request.app[REGISTRY_KEY].config_epoch())


async def handle_config_write(request: web.Request) -> web.Response:
    return http.config_error_response(
        405,
        "method_not_allowed",
        "The gateway serves a read-only mirror of the config; send writes to the config service",
        headers={"Allow": "GET"},
    )
