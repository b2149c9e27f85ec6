"""The native inference routes: ``/v1/encode``, ``/v1/score``, ``/v1/extract``, ``/v1/tokenize``."""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from gateway import responses
from gateway.http_common import read_body, respond, success_headers
from gateway.jobs import JobRequest
from gateway.parts import EXECUTOR_KEY, REGISTRY_KEY, SETTINGS_KEY
from gateway.registry import Route
from protocol import params as request_params
from protocol.api import (
    EncodeRequest,
    ExtractRequest,
    Item,
    ScoreParams,
    ScoreRequest,
    TokenizeRequest,
    parse_request,
)
from protocol.errors import invalid_input
from protocol.jobs import EncodeJob, ExtractJob, ScoreInput, ScoreJob, TokenizeJob
from protocol.work import WorkResult


async def _itemised_request(
    request: web.Request, model_cls: type[EncodeRequest] | type[ExtractRequest] | type[TokenizeRequest]
) -> tuple[str, Any, Route]:
    """The common start of encode, extract and tokenize: body within limits, item count, route."""
    model = request.match_info["model"]
    data = await read_body(request)
    req: EncodeRequest | ExtractRequest | TokenizeRequest = parse_request(model_cls, data)
    max_items = request.app[SETTINGS_KEY].gateway_max_items
    if len(req.items) > max_items:
        raise invalid_input(f"At most {max_items} items per request", param="items")
    options = request_params.request_options(req.params.options if req.params else None)
    return model, req, request.app[REGISTRY_KEY].resolve(model, options)


def _items_answer(
    request: web.Request,
    model: str,
    rid: str,
    results: list[WorkResult],
    wait_ms: float,
    *,
    allow_item_errors: bool = False,
) -> web.Response:
    """The answer of a per-item operation (encode, extract, tokenize), in the format the client
    asked for; ``allow_item_errors`` (extract): failed items answer in place, the rest succeed."""
    item_errors = responses.check_failures(results, allow_item_errors=allow_item_errors)
    t = responses.timing(results, wait_ms)
    return respond(
        request,
        lambda: responses.items_msgpack(model, results, t, item_errors),
        lambda: responses.items_json(model, results, t, item_errors),
        success_headers(rid, results, wait_ms, t),
    )


async def handle_encode(request: web.Request) -> web.Response:
    model, req, route = await _itemised_request(request, EncodeRequest)
    opts = request_params.encode_options(route.resolved, req.params)
    job = JobRequest("encode", partial(EncodeJob, params=opts), req.items)
    rid, results, wait_ms, _ = await request.app[EXECUTOR_KEY].execute(request, route, job)
    return _items_answer(request, model, rid, results, wait_ms)


async def run_score(
    request: web.Request,
    model: str,
    query: Item,
    items: list[Item],
    params: ScoreParams,
) -> tuple[str, list[WorkResult], float]:
    """One score call through the queue (the native route and the rerank routes): the item limit,
    the route, one job item; returns (request id, results, queue wait ms), failures raised."""
    max_items = request.app[SETTINGS_KEY].gateway_max_score_items
    if len(items) > max_items:
        raise invalid_input(f"At most {max_items} items per score request", param="items")
    route = request.app[REGISTRY_KEY].resolve(model, request_params.request_options(params.options))
    opts = request_params.score_options(route.resolved, params)
    job = JobRequest("score", partial(ScoreJob, params=opts), [ScoreInput(query, tuple(items))])
    rid, results, wait_ms, _ = await request.app[EXECUTOR_KEY].execute(request, route, job)
    responses.check_failures(results)
    return rid, results, wait_ms


async def handle_score(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    data = await read_body(request)
    req = parse_request(ScoreRequest, data)
    rid, results, wait_ms = await run_score(request, model, req.query, req.items, req.params)
    t = responses.timing(results, wait_ms)
    return respond(
        request,
        lambda: responses.score_msgpack(model, results[0], t),
        lambda: responses.score_json(model, results[0], t),
        success_headers(rid, results, wait_ms, t),
    )


async def handle_extract(request: web.Request) -> web.Response:
    model, req, route = await _itemised_request(request, ExtractRequest)
    opts = request_params.extract_options(route.resolved, req.params)
    job = JobRequest("extract", partial(ExtractJob, params=opts), req.items)
    rid, results, wait_ms, _ = await request.app[EXECUTOR_KEY].execute(request, route, job)
    return _items_answer(request, model, rid, results, wait_ms, allow_item_errors=True)


async def handle_tokenize(request: web.Request) -> web.Response:
    """The model's own tokenizer, run by a worker as job items of operation ``tokenize``: the
    gateway loads no tokenizers, and the worker that serves the model has it in memory already."""
    model, req, route = await _itemised_request(request, TokenizeRequest)
    opts = request_params.tokenize_options(route.resolved, req.params)
    job = JobRequest("tokenize", partial(TokenizeJob, params=opts), req.items)
    rid, results, wait_ms, _ = await request.app[EXECUTOR_KEY].execute(request, route, job)
    return _items_answer(request, model, rid, results, wait_ms)
