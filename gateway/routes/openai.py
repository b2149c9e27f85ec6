"""The OpenAI-compatible ``POST /v1/embeddings`` route."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway import responses
from gateway.core import Gateway, Provisioning
from gateway.dispatch import Lane
from gateway.http_common import (
    error_response,
    gateway_of,
    provisioning_response,
    read_body,
    success_headers,
)
from protocol.catalog import supported_outputs
from protocol.codec import unpackb
from protocol.errors import ErrorCode, SIEError, invalid_input
from protocol.work import WorkItem


async def handle_embeddings(request: web.Request) -> web.Response:
    """OpenAI-compatible ``POST /v1/embeddings`` (contract 7): JSON in, JSON out, OpenAI errors."""
    gw = gateway_of(request)
    try:
        return await _embeddings(gw, request)
    except Provisioning as p:
        return provisioning_response(gw, request, p, force_503=True)
    except SIEError as err:
        return error_response(err, openai=True)


async def _embeddings(gw: Gateway, request: web.Request) -> web.Response:
    import base64

    import numpy as np

    data = await read_body(request, gw.settings)
    if not isinstance(data, dict):
        raise invalid_input("Request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_input("'model' is required", param="model")
    inputs = data.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list):
        raise invalid_input("'input' must be a string or an array of strings", param="input")
    if not inputs:
        raise invalid_input("Input cannot be empty", param="input")
    if not all(isinstance(x, str) for x in inputs):
        raise invalid_input("token-array embeddings input is not supported", param="input")
    if len(inputs) > gw.settings.gateway_max_items:
        raise invalid_input(f"At most {gw.settings.gateway_max_items} inputs per request", param="input")
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise invalid_input("encoding_format must be 'float' or 'base64'", param="encoding_format")
    try:
        route = gw.registry.resolve(model)
    except SIEError as err:
        if err.code == ErrorCode.MODEL_NOT_FOUND:
            raise SIEError(ErrorCode.MODEL_NOT_FOUND, err.message, param="model") from None
        raise
    if "dense" not in supported_outputs(route.resolved):
        raise invalid_input(f"Model '{model}' does not produce dense embeddings", param="model")
    dims = data.get("dimensions")
    enc = route.resolved.config.tasks.encode
    native = enc.dense.dim if enc and enc.dense else None
    if dims is not None and dims != native:
        err = invalid_input(
            f"dimensions must equal the model's native dimension ({native})", param="dimensions"
        )
        err.extra["openai_code"] = "unsupported_field"
        raise SIEError("unsupported_field", err.message, status=400, param="dimensions")
    runtime = route.resolved.runtime_options
    instruction = runtime.get("instruction")
    is_query = bool(runtime.get("is_query", False))

    def build(lane: Lane, rid: str, reply: str, deadline_ts: float) -> list[WorkItem]:
        return [
            gw.work_item(
                lane=lane, route=route, request_id=rid, reply=reply, deadline_ts=deadline_ts, index=i,
                total=len(inputs), operation="encode", item={"text": inputs[i]}, output_types=["dense"],
                output_dtype="float32", instruction=instruction, is_query=is_query, options={},
            )
            for i in range(len(inputs))
        ]  # fmt: skip

    rid, results, wait_ms, _ = await gw.execute(request, route, "encode", build, len(inputs))
    responses.check_failures(results)
    out = []
    for r in results:
        item = unpackb(r.result_msgpack) if r.result_msgpack else {}
        values = np.asarray((item.get("dense") or {}).get("values"), dtype=np.float32).reshape(-1)
        if fmt == "base64":
            emb: Any = base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
        else:
            emb = [float(v) for v in values]
        out.append({"object": "embedding", "embedding": emb, "index": r.item_index})
    tokens = responses.input_tokens(results)
    source = "worker"
    if tokens is None:
        tokens = max(1, sum(len(s) for s in inputs) // 4)
        source = "character_estimate"
    body = {
        "object": "list",
        "data": out,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "sie_token_source": source},
    }
    return web.json_response(body, headers=success_headers(rid, results, wait_ms))
