"""The OpenAI-compatible ``POST /v1/embeddings`` route."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from gateway import responses
from gateway.http_common import (
    error_response,
    provisioning_response,
    read_body,
    success_headers,
)
from gateway.jobs import JobRequest
from gateway.lanes import Provisioning
from gateway.parts import EXECUTOR_KEY, REGISTRY_KEY, SETTINGS_KEY
from protocol import openai
from protocol.api import EncodeParams, Item
from protocol.codec import unpackb
from protocol.errors import SIEError
from protocol.jobs import EncodeJob
from protocol.params import encode_options


async def handle_embeddings(request: web.Request) -> web.Response:
    """OpenAI-compatible ``POST /v1/embeddings``: JSON in, JSON out, OpenAI errors."""
    try:
        return await _embeddings(request)
    except Provisioning as p:
        return provisioning_response(request, p, force_503=True)
    except SIEError as err:
        return error_response(err, openai=True)


async def _embeddings(request: web.Request) -> web.Response:
    data = await read_body(request)
    req = openai.parse_embeddings_request(data, max_inputs=request.app[SETTINGS_KEY].gateway_max_items)
    model, inputs = req.model, req.inputs
    route = openai.resolve_model(request.app[REGISTRY_KEY].resolve, model)
    options = openai.dimension_options(req.dimensions, openai.dense_dimension(route.resolved, model))
    params = EncodeParams(output_types=["dense"], output_dtype="float32", options=options)
    opts = encode_options(route.resolved, params)  # the profile's instruction and query flag apply
    job = JobRequest("encode", partial(EncodeJob, params=opts), [Item(text=text) for text in inputs])
    rid, results, wait_ms, _ = await request.app[EXECUTOR_KEY].execute(request, route, job)
    responses.check_failures(results)
    rows = []
    for r in results:
        item = unpackb(r.result_msgpack) if r.result_msgpack else {}
        rows.append(
            openai.embedding_row((item.get("dense") or {}).get("values"), r.item_index, req.encoding_format)
        )
    body = openai.embeddings_response(model, rows, inputs, responses.input_tokens(results))
    return web.json_response(body, headers=success_headers(rid, results, wait_ms))
