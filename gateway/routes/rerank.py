"""The rerank routes in other servers' shapes (``POST /v1/rerank``, ``/v2/rerank``: Cohere;
``POST /rerank``: TEI), answered by the score path; shapes in ``protocol/rerank.py``."""

from __future__ import annotations

from aiohttp import web

from gateway import responses
from gateway.http_common import (
    provisioning_response,
    read_body,
    success_headers,
)
from gateway.lanes import Provisioning
from gateway.parts import SETTINGS_KEY
from gateway.routes.inference import run_score
from iokit import http
from protocol import rerank
from protocol.api import ScoreParams
from protocol.codec import unpackb
from protocol.errors import SIEError


async def handle_rerank(request: web.Request) -> web.Response:
    """One handler for the three rerank routes: JSON in, JSON out, errors in the OpenAI envelope
    (Cohere's routes) or TEI's shape (TEI's)."""
    try:
        data = await read_body(request)
        default_model = request.app[SETTINGS_KEY].gateway_rerank_default_model
        call = rerank.parse(request.path, data, default_model=default_model)
        try:
            rid, results, wait_ms = await run_score(
                request,
                call.model,
                call.query_item(),
                call.score_items(),
                ScoreParams(options=call.options),
            )
        except SIEError as err:
            raise rerank.in_request_terms(err, call.kind) from None
    except Provisioning as p:
        return provisioning_response(request, p, force_503=True)
    except SIEError as err:
        return http.rerank_error_response(err, request.path)
    blob = results[0].result_msgpack
    ranked = rerank.ranking(unpackb(blob) if blob else [], len(call.texts))
    body = rerank.answer(call, ranked, rid, responses.input_tokens(results))
    return web.json_response(body, headers=success_headers(rid, results, wait_ms))
