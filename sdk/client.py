"""Synchronous client (httpx): ``SIEClient``, the blocking shell around :mod:`sdk._calls`."""

from __future__ import annotations

import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

import httpx

from sdk import _calls as C
from sdk import _wire as W
from sdk import status as S
from sdk._core import (
    Call,
    Failure,
    Renewal,
    Reply,
    Request,
    Response,
    Session,
    SessionFacts,
    Sleep,
    method_signature,
)
from sdk._retry import Transport
from sdk.types import Options

P = ParamSpec("P")
T = TypeVar("T")
log = logging.getLogger("sdk.pools")


def _transport_kind(exc: httpx.TransportError) -> Transport:
    if isinstance(exc, httpx.ReadTimeout):
        return Transport.FATAL  # the request went out; it may have run
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ssl.SSLError):
                return Transport.FATAL
            cause = cause.__cause__ or cause.__context__
        return Transport.UNREACHED  # refused, or the name did not resolve
    if isinstance(exc, httpx.ConnectTimeout):
        return Transport.UNREACHED
    if isinstance(
        exc, (httpx.PoolTimeout, httpx.WriteTimeout, httpx.NetworkError, httpx.RemoteProtocolError)
    ):
        return Transport.RETRYABLE
    return Transport.FATAL


def _blocking(call: Callable[Concatenate[Session, P], Call[T]]) -> Callable[Concatenate[SIEClient, P], T]:
    """The method of ``SIEClient`` that runs ``call`` to its end and returns its result."""

    @functools.wraps(call)
    def method(client: SIEClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return client._run(call(client._session, *args, **kwargs))

    method.__signature__ = method_signature(call)  # type: ignore[attr-defined]
    return method


class _Stopped(Exception):
    """Raised out of a renewal's sleep when the renewal is stopped."""


class _Renewer:
    """Renews one pool lease from a daemon thread until stopped."""

    def __init__(self, client: SIEClient, name: str) -> None:
        self._stop = threading.Event()
        renewal = C.renew_lease(client._session, name, client.lease_renewal_interval_s)
        self._thread = threading.Thread(
            target=self._renew, args=(client, renewal), name=f"sie-pool-renew-{name}", daemon=True
        )
        self._thread.start()

    def _renew(self, client: SIEClient, renewal: Call[None]) -> None:
        try:
            client._run(renewal, self._sleep)
        except _Stopped:
            pass
        except Exception as exc:  # e.g. the client was closed under it
            log.debug("lease renewal ended: %r", exc)

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise _Stopped

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


class SIEClient(SessionFacts):
    """Client for an sie-cluster gateway or a standalone ``sie serve`` worker.

    Call-compatible with ``sie_sdk.SIEClient``: ``encode``, ``score``, ``extract``,
    ``list_models``, ``get_model``, ``get_capacity``, ``wait_for_capacity``, ``watch``,
    ``create_pool``/``get_pool``/``delete_pool``, ``close`` and use as a context manager.

    ``api_key`` (else ``SIE_API_KEY``) goes with every request as its bearer token. A gateway wants
    its admin token (its SIE_ADMIN_TOKEN; ``sie up``'s ``pool-admin-token``) for pool writes in every
    auth mode: ``admin_key`` sends that one with ``create_pool``, the lease renewals and
    ``delete_pool`` only (without it they go with ``api_key``, as the public SDK sends them).
    """

    lease_renewal_interval_s: float = W.DEFAULT_LEASE_RENEWAL_INTERVAL_S

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
        gpu: str | None = None,
        priority: str | None = None,
        options: Options | None = None,
        max_connections: int | None = None,
        base_url_headers: Mapping[str, str] | None = None,
        connect_timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        remote: str | None = None,
        http_client: httpx.Client | None = None,
        lease_renewal_interval_s: float | None = None,
    ) -> None:
        self._session = Session.configure(
            base_url,
            timeout_s=timeout_s,
            api_key=api_key,
            admin_key=admin_key,
            gpu=gpu,
            priority=priority,
            options=options,
            base_url_headers=base_url_headers,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            remote=remote,
        )
        if lease_renewal_interval_s is not None:
            self.lease_renewal_interval_s = float(lease_renewal_interval_s)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(
            timeout=httpx.Timeout(self._session.read_timeout, connect=self._session.connect_timeout),
            limits=httpx.Limits(
                max_connections=max_connections or 100, max_keepalive_connections=max_connections or 20
            ),
            follow_redirects=False,
        )
        self._renewers: dict[str, _Renewer] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------ the I/O of the core's steps

    def _run(self, call: Call[T], sleep: Callable[[float], None] = time.sleep) -> T:
        reply: Reply | None = None
        try:
            while True:
                step = call.send(reply)
                reply = None
                if isinstance(step, Request):
                    reply = self._exchange(step)
                elif isinstance(step, Sleep):
                    sleep(step.seconds)
                else:
                    self._renewal(step)
        except StopIteration as done:
            result: T = done.value
            return result

    def _exchange(self, request: Request) -> Reply:
        if self._closed:
            raise RuntimeError("this SIEClient is closed")
        timeout = httpx.Timeout(
            request.read_timeout, connect=request.connect_timeout, pool=request.connect_timeout
        )
        try:
            response = self._http.request(
                request.method, request.url, headers=request.headers, content=request.body, timeout=timeout
            )
        except httpx.TransportError as exc:
            return Failure(_transport_kind(exc), exc)
        return Response(response.status_code, response.headers, response.content)

    def _renewal(self, step: Renewal) -> None:
        with self._lock:
            renewer = self._renewers.pop(step.pool, None)
            if step.keep and not self._closed:
                self._renewers[step.pool] = renewer or _Renewer(self, step.pool)
                return
        if renewer is not None:
            renewer.stop()

    # ------------------------------------------------------------ the calls (sdk._calls)

    encode = _blocking(C.encode)
    score = _blocking(C.score)
    extract = _blocking(C.extract)
    tokenize = _blocking(C.tokenize)
    list_models = _blocking(C.list_models)
    get_model = _blocking(C.get_model)
    get_capacity = _blocking(C.get_capacity)
    wait_for_capacity = _blocking(C.wait_for_capacity)
    create_pool = _blocking(C.create_pool)
    get_pool = _blocking(C.get_pool)
    delete_pool = _blocking(C.delete_pool)

    def watch(self, *, mode: S.WatchMode = "auto") -> Iterator[dict[str, Any]]:
        """Status frames from ``/ws/cluster-status`` (gateway) or ``/ws/status`` (worker) until the server
        closes the stream; ``mode="auto"`` asks ``/health`` which one this is."""
        s = self._session
        path = S.watch_path(mode, self._run(C.is_gateway(s)) if mode == "auto" else None)
        yield from S.watch_sync(S.ws_url(s.base_url, path), s.headers, s.connect_timeout)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop every lease renewal and release the connections."""
        with self._lock:
            renewers = list(self._renewers.values())
            self._renewers.clear()
            closed, self._closed = self._closed, True
        for renewer in renewers:
            renewer.stop()
        if not closed and self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
