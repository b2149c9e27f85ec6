"""Every call of the clients, written once as a sans-I/O generator over a :class:`Session`.

``SIEClient`` runs these with httpx and ``time.sleep``, ``SIEAsyncClient`` with aiohttp and
``asyncio.sleep`` (see :mod:`sdk._core` for the steps). The public methods of both clients are these
functions: their names, arguments, defaults and docstrings.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.codec import packb
from sdk import _answers as A
from sdk import _wire as W
from sdk import pools as P
from sdk import status as S
from sdk._core import Call, Failure, Renewal, Reply, Request, Response, Session, Sleep
from sdk._retry import RESOURCE_EXHAUSTED_MAX_RETRIES, Decision, RetryState, attempt_timeout
from sdk.errors import RequestError, SIEConnectionError, SIEError
from sdk.types import Capacity, ModelInfo, Options, PoolInfo, ScoreResult

log = logging.getLogger("sdk.pools")


@dataclass(frozen=True, slots=True)
class Route:
    """Where an inference call goes (``gpu``: profile or pool/profile), and how long it may wait."""

    gpu: str | None
    priority: str | None
    wait_for_capacity: bool
    provision_timeout_s: float | None
    max_oom_retries: int


# ---------------------------------------------------------------- one exchange


def _exchange(s: Session, request: Request) -> Call[Reply]:
    reply = yield request
    if isinstance(reply, Response):
        s.observe(reply)
        return reply
    if isinstance(reply, Failure):
        return reply
    raise TypeError(f"a Request is answered with a Response or a Failure, not {reply!r}")


def _simple(
    s: Session, method: str, path: str, headers: Mapping[str, str], body: bytes | None = None
) -> Call[Response]:
    """One attempt of a call that is not retried; no answer at all is ``SIEConnectionError``."""
    reply = yield from _exchange(s, s.request(method, path, headers, body))
    if isinstance(reply, Failure):
        raise SIEConnectionError(f"{method} {s.base_url}{path} failed: {reply.error!r}") from reply.error
    return reply


def _json(response: Response, *, what: str, model: str | None = None) -> dict[str, Any]:
    if response.status >= 300:
        raise A.terminal_error(A.ErrorInfo(response.status, response.headers, response.body), model=model)
    return A.decode_json_object(response.body, what=what, status=response.status)


def _get_json(s: Session, path: str, *, what: str, model: str | None = None) -> Call[dict[str, Any]]:
    return _json((yield from _simple(s, "GET", path, W.JSON_HEADERS)), what=what, model=model)


def _infer(
    s: Session, operation: str, model: str, body: W.Body, route: Route, lora: str | None = None
) -> Call[tuple[dict[str, Any], Mapping[str, str]]]:
    """POST one inference request through the retry matrix: the decoded answer and its headers."""
    gpu = route.gpu if route.gpu is not None else s.gpu
    headers = {**W.routing_headers(gpu), **W.priority_headers(route.priority or s.priority)}
    payload = packb(body)
    state = RetryState.start(
        s.clock(),
        provision_timeout_s=route.provision_timeout_s,
        wait_for_capacity=route.wait_for_capacity,
        max_oom_retries=route.max_oom_retries,
        server_seen=s.server_seen,
    )
    s.last_retry_count = 0
    try:
        while True:
            read = attempt_timeout(s.read_timeout, state, s.clock())
            reply = yield from _exchange(
                s, s.request("POST", f"/v1/{operation}/{model}", headers, payload, read)
            )
            if isinstance(reply, Failure):
                decision = A.judge_transport(
                    reply.kind, reply.error, state, s.clock(), operation=operation, base_url=s.base_url
                )
            else:
                outcome = A.judge(
                    reply, state, s.clock(), operation=operation, model=model, gpu=gpu, lora=lora
                )
                if not isinstance(outcome, Decision):
                    return outcome, reply.headers
                decision = outcome
            yield Sleep(decision.delay)
    finally:
        s.last_retry_count = state.retries


def _one_or_all(results: list[Any], single: bool) -> Any:
    return results[0] if single else results


# ---------------------------------------------------------------- inference


def encode(
    s: Session,
    model: str,
    items: Any,
    *,
    output_types: Sequence[str] | None = None,
    instruction: str | None = None,
    output_dtype: str | None = None,
    is_query: bool | None = None,
    options: Options | None = None,
    gpu: str | None = None,
    priority: str | None = None,
    wait_for_capacity: bool = True,
    provision_timeout_s: float | None = None,
    max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES,
) -> Call[Any]:
    """Encode one item (returns one ``EncodeResult``) or a list of items (returns a list)."""
    opts = W.merge_options(s.options, options)
    body, sent, single = W.items_body(
        items,
        output_types=output_types,
        instruction=instruction,
        output_dtype=output_dtype,
        options=opts if is_query is None else {**opts, "is_query": bool(is_query)},
    )
    lora = opts.get("lora_id") or opts.get("lora")
    route = Route(gpu, priority, wait_for_capacity, provision_timeout_s, max_oom_retries)
    data, headers = yield from _infer(
        s, "encode", model, body, route, lora=lora if isinstance(lora, str) else None
    )
    return _one_or_all(A.parse_encode(data, model, sent, headers), single)


def score(
    s: Session,
    model: str,
    query: Any,
    items: list[Any],
    *,
    instruction: str | None = None,
    options: Options | None = None,
    gpu: str | None = None,
    priority: str | None = None,
    wait_for_capacity: bool = True,
    provision_timeout_s: float | None = None,
    max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES,
) -> Call[ScoreResult]:
    """Score ``items`` against ``query``; entries come sorted by descending score."""
    body = W.score_body(query, items, instruction=instruction, options=W.merge_options(s.options, options))
    route = Route(gpu, priority, wait_for_capacity, provision_timeout_s, max_oom_retries)
    data, headers = yield from _infer(s, "score", model, body, route)
    return A.parse_score(data, model, headers)


def extract(
    s: Session,
    model: str,
    items: Any,
    *,
    labels: list[str] | None = None,
    output_schema: Mapping[str, Any] | None = None,
    instruction: str | None = None,
    options: Options | None = None,
    gpu: str | None = None,
    priority: str | None = None,
    wait_for_capacity: bool = True,
    provision_timeout_s: float | None = None,
    max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES,
) -> Call[Any]:
    """Extract entities, relations, classes or structured data from one item (one ``ExtractResult``)
    or a list."""
    body, sent, single = W.items_body(
        items,
        labels=labels,
        output_schema=output_schema,
        instruction=instruction,
        options=W.merge_options(s.options, options),
    )
    route = Route(gpu, priority, wait_for_capacity, provision_timeout_s, max_oom_retries)
    data, headers = yield from _infer(s, "extract", model, body, route)
    return _one_or_all(A.parse_extract(data, model, sent, headers), single)


def tokenize(
    s: Session,
    model: str,
    items: Any,
    *,
    options: Options | None = None,
    gpu: str | None = None,
    priority: str | None = None,
    wait_for_capacity: bool = True,
    provision_timeout_s: float | None = None,
) -> Call[Any]:
    """The model's own tokenizer over one item or a list: ``tokens``, ``ids``, ``offsets``
    (character spans) and ``count`` per item (``options={"add_special_tokens": False}`` to
    leave out [CLS]/[SEP] and the like)."""
    body, sent, single = W.items_body(items, options=W.merge_options(s.options, options))
    route = Route(gpu, priority, wait_for_capacity, provision_timeout_s, 0)
    data, headers = yield from _infer(s, "tokenize", model, body, route)
    return _one_or_all(A.parse_tokenize(data, model, sent, headers), single)


# ---------------------------------------------------------------- models and capacity


def list_models(s: Session) -> Call[list[ModelInfo]]:
    """The models the server serves (``GET /v1/models``)."""
    return A.models_list((yield from _get_json(s, "/v1/models", what="models")))


def get_model(s: Session, model: str) -> Call[dict[str, Any]]:
    """One model's entry and configuration (``GET /v1/models/{model}``), as the server sends it."""
    return (yield from _get_json(s, f"/v1/models/{model}", what="model", model=model))


def get_capacity(s: Session, *, gpu: str | None = None) -> Call[Capacity]:
    """Cluster capacity from the gateway's ``/health`` (a worker raises ``RequestError``)."""
    return A.parse_capacity((yield from _get_json(s, "/health", what="health")), gpu)


def is_gateway(s: Session) -> Call[bool]:
    """Whether ``/health`` says that the server is a gateway (what ``watch(mode="auto")`` asks)."""
    try:
        response = yield from _simple(s, "GET", "/health", W.JSON_HEADERS)
        return response.status == 200 and S.is_gateway(
            A.decode_json_object(response.body, what="health", status=response.status)
        )
    except SIEError:
        return False


def wait_for_capacity(
    s: Session,
    gpu: str,
    *,
    model: str | None = None,
    timeout_s: float | None = None,
    poll_interval_s: float = 5.0,
) -> Call[Capacity]:
    """Wait until the gateway has workers of ``gpu``; with ``model``, a warm-up encode (which scales
    up and loads the model) first. Raises ``ProvisioningError`` after ``timeout_s`` (default 900 s)."""
    if model:
        yield from encode(s, model, {"text": "warmup"}, gpu=gpu, provision_timeout_s=timeout_s)
        return (yield from get_capacity(s, gpu=gpu))
    state = S.capacity_state(s.clock(), timeout_s, server_seen=s.server_seen)
    while True:
        reply = yield from _exchange(s, s.request("GET", "/health", W.JSON_HEADERS))
        if isinstance(reply, Response):
            try:
                capacity = A.parse_capacity(_json(reply, what="health"), gpu)
                if capacity["worker_count"] > 0:
                    return capacity
            except RequestError:
                pass  # not a gateway yet: keep waiting
        failed = reply if isinstance(reply, Failure) else None
        delay = S.capacity_wait(
            failed, state, s.clock(), gpu=gpu, poll_interval_s=poll_interval_s, base_url=s.base_url
        )
        yield Sleep(delay)


# ---------------------------------------------------------------- pools


def create_pool(
    s: Session,
    name: str,
    gpus: dict[str, int] | None = None,
    gpu_caps: dict[str, int] | None = None,
    bundle: str | None = None,
    minimum_worker_count: int | None = None,
    pinned_models: list[str] | None = None,
    *,
    queue_pool: str | None = None,
) -> Call[None]:
    """Create (or update) a pool and keep its lease renewed until ``delete_pool`` or ``close``."""
    body = P.create_body(
        name,
        gpus=gpus,
        gpu_caps=gpu_caps,
        bundle=bundle,
        minimum_worker_count=minimum_worker_count,
        pinned_models=pinned_models,
        queue_pool=queue_pool,
    )
    headers = {**W.JSON_BODY_HEADERS, **s.admin_headers}
    response = yield from _simple(s, "POST", "/v1/pools", headers, W.json_bytes(body))
    P.created(name, response.status, response.body)
    yield Renewal(name, keep=True)


def get_pool(s: Session, name: str) -> Call[PoolInfo | None]:
    """The pool's spec and status; ``None`` when the gateway does not know it."""
    response = yield from _simple(s, "GET", f"/v1/pools/{name}", W.JSON_HEADERS)
    return P.info(name, response.status, response.body)


def delete_pool(s: Session, name: str) -> Call[bool]:
    """Stop renewing and delete the pool; ``False`` when the gateway does not know it."""
    yield Renewal(name, keep=False)
    response = yield from _simple(s, "DELETE", f"/v1/pools/{name}", {**W.JSON_HEADERS, **s.admin_headers})
    return P.deleted(name, response.status, response.body)


def renew_lease(s: Session, name: str, interval_s: float) -> Call[None]:
    """Renew the pool's lease every ``interval_s`` until the client stops the call; a failed
    renewal is retried a few times with a short backoff, then the next cycle tries again (the
    lease lasts far longer than the interval)."""
    request = s.request("POST", f"/v1/pools/{name}/renew", {**W.JSON_HEADERS, **s.admin_headers})
    while True:
        yield Sleep(interval_s)
        for backoff in (*P.renewal_backoff(interval_s), None):
            reply = yield from _exchange(s, request)
            if isinstance(reply, Response) and reply.status < 400:
                break
            log.debug("renewing pool %s failed: %s", name, reply)
            if backoff is not None:
                yield Sleep(backoff)
        else:
            log.warning("could not renew the lease of pool %s; trying again next cycle", name)
