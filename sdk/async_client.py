"""Asynchronous client (aiohttp): ``SIEAsyncClient``; same calls as ``SIEClient``, awaited (the
asyncio shell around :mod:`sdk._calls`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

import aiohttp

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

_CONNECT_TIMEOUTS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(aiohttp, "ConnectionTimeoutError", None),) if t is not None
)
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError)


def _transport_kind(exc: BaseException) -> Transport:
    if isinstance(exc, (aiohttp.ClientSSLError, aiohttp.ClientConnectorCertificateError)):
        return Transport.FATAL
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Transport.UNREACHED  # refused, or the name did not resolve
    if _CONNECT_TIMEOUTS and isinstance(exc, _CONNECT_TIMEOUTS):
        return Transport.UNREACHED  # connect timeout: nothing was sent
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return Transport.FATAL  # read timeout: the request may have run
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
        return Transport.RETRYABLE  # reset, peer closed mid-answer
    return Transport.FATAL


def _awaited(
    call: Callable[Concatenate[Session, P], Call[T]],
) -> Callable[Concatenate[SIEAsyncClient, P], Coroutine[Any, Any, T]]:
    """The coroutine method of ``SIEAsyncClient`` that runs ``call`` to its end."""

    @functools.wraps(call)
    async def method(client: SIEAsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await client._run(call(client._session, *args, **kwargs))

    method.__signature__ = method_signature(call)  # type: ignore[attr-defined]
    return method


class _Renewer:
    """Renews one pool lease from a task in the client's event loop until stopped."""

    def __init__(self, client: SIEAsyncClient, name: str) -> None:
        renewal = C.renew_lease(client._session, name, client.lease_renewal_interval_s)
        self._task = asyncio.get_running_loop().create_task(
            self._renew(client, renewal), name=f"sie-pool-renew-{name}"
        )

    @staticmethod
    async def _renew(client: SIEAsyncClient, renewal: Call[None]) -> None:
        try:
            await client._run(renewal)
        except Exception as exc:  # e.g. the client was closed under it
            log.debug("lease renewal ended: %r", exc)

    async def stop(self) -> None:
        task = self._task
        if task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise


class SIEAsyncClient(SessionFacts):
    """Async twin of :class:`sdk.SIEClient`; use ``async with`` or ``await client.close()``."""

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
        session: aiohttp.ClientSession | None = None,
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
        self._max_connections = max_connections or 100
        self._http = session
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._owns_http = session is None
        self._renewers: dict[str, _Renewer] = {}
        self._closed = False

    # ------------------------------------------------------------ the I/O of the core's steps

    async def _run(self, call: Call[T]) -> T:
        reply: Reply | None = None
        try:
            while True:
                step = call.send(reply)
                reply = None
                if isinstance(step, Request):
                    reply = await self._exchange(step)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    await self._renewal(step)
        except StopIteration as done:
            result: T = done.value
            return result

    def _get_http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("this SIEAsyncClient is closed")
        loop = asyncio.get_running_loop()
        stale = self._owns_http and self._http is not None and self._http_loop is not loop
        if self._http is None or self._http.closed or stale:
            # Created lazily so that it binds to the loop the client is used in; a client
            # reused from another loop (e.g. successive asyncio.run calls) gets a new one.
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._http = aiohttp.ClientSession(connector=connector, auto_decompress=True)
            self._http_loop = loop
            self._owns_http = True
        return self._http

    async def _exchange(self, request: Request) -> Reply:
        connect = request.connect_timeout
        timeout = aiohttp.ClientTimeout(
            total=None, connect=connect, sock_connect=connect, sock_read=request.read_timeout
        )
        http = self._get_http()
        try:
            async with http.request(
                request.method,
                request.url,
                headers=request.headers,
                data=request.body,
                timeout=timeout,
                allow_redirects=False,
            ) as response:
                return Response(response.status, response.headers, await response.read())
        except _TRANSPORT_ERRORS as exc:
            return Failure(_transport_kind(exc), exc)

    async def _renewal(self, step: Renewal) -> None:
        renewer = self._renewers.pop(step.pool, None)
        if step.keep and not self._closed:
            self._renewers[step.pool] = renewer or _Renewer(self, step.pool)
        elif renewer is not None:
            await renewer.stop()

    # ------------------------------------------------------------ the calls (sdk._calls)

    encode = _awaited(C.encode)
    score = _awaited(C.score)
    extract = _awaited(C.extract)
    tokenize = _awaited(C.tokenize)
    list_models = _awaited(C.list_models)
    get_model = _awaited(C.get_model)
    get_capacity = _awaited(C.get_capacity)
    wait_for_capacity = _awaited(C.wait_for_capacity)
    create_pool = _awaited(C.create_pool)
    get_pool = _awaited(C.get_pool)
    delete_pool = _awaited(C.delete_pool)

    async def watch(self, *, mode: S.WatchMode = "auto") -> AsyncIterator[dict[str, Any]]:
        """Async twin of :meth:`sdk.SIEClient.watch`."""
        s = self._session
        path = S.watch_path(mode, await self._run(C.is_gateway(s)) if mode == "auto" else None)
        async for frame in S.watch_async(S.ws_url(s.base_url, path), s.headers, s.connect_timeout):
            yield frame

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        renewers = list(self._renewers.values())
        self._renewers.clear()
        for renewer in renewers:
            await renewer.stop()
        self._closed = True
        if self._http is not None and self._owns_http and not self._http.closed:
            await self._http.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
