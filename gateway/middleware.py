"""The gateway's one middleware: auth, errors to envelopes, request metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import nats.errors
import nats.js.errors
from aiohttp import web

from gateway import auth
from gateway.executor import REQUEST_ID_KEY
from gateway.http_common import error_response, provisioning_response
from gateway.lanes import Provisioning
from gateway.metrics import labelled
from gateway.parts import ADMISSION_KEY, METRICS_KEY, SETTINGS_KEY
from iokit import http
from protocol import SERVER_VERSION, rerank
from protocol.errors import ErrorCode, SIEError

log = logging.getLogger(__name__)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    admission = request.app[ADMISSION_KEY]
    metrics = request.app[METRICS_KEY]
    settings = request.app[SETTINGS_KEY]
    t0 = time.monotonic()
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    status = 500
    openai_route = request.path == "/v1/embeddings" or request.path in rerank.ROUTES  # OpenAI envelope there
    counted = request.path.startswith("/v1/")  # API requests: what a drain waits for
    if counted and admission.draining:
        draining = SIEError(
            ErrorCode.QUEUE_UNAVAILABLE, "This gateway is shutting down; retry shortly", retry_after=1
        )
        metrics.requests.labels(endpoint, str(draining.status), "").inc()
        resp = error_response(draining, openai=openai_route)
        resp.force_close()  # the client's next try opens a new connection (to a live replica)
        return resp
    if counted:
        admission.enter()
    try:
        auth.check(
            request,
            enabled=settings.auth_enabled,
            tokens=settings.inference_tokens(),
            admin_token=settings.admin_token,
            exempt_operational=settings.auth_exempt_operational,
        )
        response: web.StreamResponse = await handler(request)
        status = response.status
        return response
    except Provisioning as p:
        response = provisioning_response(request, p)
        status = response.status
        return response
    except SIEError as err:
        status = err.status
        metrics.rejected.labels("", "", err.code.lower()).inc()
        resp = error_response(err, openai=openai_route)
        if REQUEST_ID_KEY in request:
            resp.headers["X-SIE-Request-ID"] = request[REQUEST_ID_KEY]
        resp.headers["X-SIE-Server-Version"] = SERVER_VERSION
        return resp
    except web.HTTPException as exc:
        status = exc.status
        if exc.status >= 400:
            return error_response(http.error_for_http_exception(exc), openai=openai_route)
        raise
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        unavailable = SIEError(
            ErrorCode.QUEUE_UNAVAILABLE,
            f"NATS unavailable ({type(exc).__name__}); retry later",
            retry_after=2,
        )
        status = unavailable.status
        return error_response(unavailable, openai=openai_route)
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as exc:  # never leak a traceback; never disturb other requests
        log.exception("unhandled error on %s", request.path)
        return error_response(http.unexpected_error(exc), openai=openai_route)
    finally:
        if counted:
            admission.leave()
        profile = request.headers.get("X-SIE-MACHINE-PROFILE", "") or ""
        labelled(metrics.requests, endpoint, str(status), profile.lower()[:64]).inc()
        labelled(metrics.latency, endpoint).observe(time.monotonic() - t0)
