"""Asynchronous client (aiohttp): ``SIEAsyncClient``; same calls as ``SIEClient``, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Self

import aiohttp

from protocol.codec import packb
from sdk import _wire as W
from sdk import pools as P
from sdk import status as S
from sdk._retry import (
    RESOURCE_EXHAUSTED_MAX_RETRIES,
    RetryState,
    Transport,
    attempt_timeout,
)
from sdk.errors import RequestError, SIEConnectionError, SIEError

_CONNECT_TIMEOUTS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(aiohttp, "ConnectionTimeoutError", None),) if t is not None
)


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


_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError)


class _Answer:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class SIEAsyncClient:
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
        options: dict[str, Any] | None = None,
        max_connections: int | None = None,
        base_url_headers: Mapping[str, str] | None = None,
        connect_timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        remote: str | None = None,
        session: aiohttp.ClientSession | None = None,
        lease_renewal_interval_s: float | None = None,
    ) -> None:
        self._base_url = W.resolve_base_url(base_url)
        self._api_key = W.resolve_api_key(api_key, self._base_url)
        self._admin_headers = W.admin_headers(admin_key)  # pool writes: the gateway's admin token
        self._connect_timeout, self._read_timeout = W.resolve_timeouts(
            timeout_s, connect_timeout_s, read_timeout_s
        )
        self._default_gpu = gpu
        self._default_priority = W.check_priority(priority)
        self._default_options = dict(options or {})
        if lease_renewal_interval_s is not None:
            self.lease_renewal_interval_s = float(lease_renewal_interval_s)
        self._headers = W.default_headers(self._api_key, remote)
        self._headers.update(base_url_headers or {})
        self._max_connections = max_connections or 100
        self._session = session
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._owns_session = session is None
        self._renewers: dict[str, P.TaskRenewer] = {}
        self._last_retry_count = 0
        self._last_model_revision: str | None = None
        self._warned_skew = False
        self._server_seen = False  # an HTTP answer came: a refused connection is then a restart
        self._closed = False

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def last_retry_count(self) -> int:
        return self._last_retry_count

    @property
    def last_model_revision(self) -> str | None:
        return self._last_model_revision

    # ------------------------------------------------------------ plumbing

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("this SIEAsyncClient is closed")
        loop = asyncio.get_running_loop()
        stale = self._owns_session and self._session is not None and self._session_loop is not loop
        if self._session is None or self._session.closed or stale:
            # Created lazily so that it binds to the loop the client is used in; a client
            # reused from another loop (e.g. successive asyncio.run calls) gets a new one.
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
            self._session_loop = loop
            self._owns_session = True
        return self._session

    async def _send(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        data: bytes | None = None,
        read_timeout: float | None = None,
    ) -> _Answer:
        merged = dict(self._headers)
        merged.update(headers or {})
        read = read_timeout or self._read_timeout
        connect = min(self._connect_timeout, read)
        timeout = aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect, sock_read=read)
        async with self._get_session().request(
            method, self._base_url + path, headers=merged, data=data, timeout=timeout, allow_redirects=False
        ) as response:
            body = await response.read()
            answer = _Answer(response.status, response.headers, body)
        self._observe(answer.headers)
        return answer

    def _observe(self, headers: Mapping[str, str]) -> None:
        self._server_seen = True
        revision = headers.get("X-SIE-Model-Revision")
        if revision:
            self._last_model_revision = revision
        if not self._warned_skew:
            warning = W.version_skew(headers.get("X-SIE-Server-Version"))
            if warning:
                self._warned_skew = True
                W.log.warning(warning)

    async def _simple(self, method: str, path: str, **kw: Any) -> _Answer:
        try:
            return await self._send(method, path, **kw)
        except _TRANSPORT_ERRORS as exc:
            raise SIEConnectionError(f"{method} {self._base_url}{path} failed: {exc!r}") from exc

    async def _infer(
        self,
        operation: str,
        model: str,
        body: dict[str, Any],
        *,
        gpu: str | None,
        wait_for_capacity: bool,
        priority: str | None = None,
        provision_timeout_s: float | None,
        max_oom_retries: int,
        lora: str | None = None,
    ) -> tuple[dict[str, Any], Mapping[str, str]]:
        gpu = gpu if gpu is not None else self._default_gpu
        headers = {**W.routing_headers(gpu), **W.priority_headers(priority or self._default_priority)}
        payload = packb(body)
        path = f"/v1/{operation}/{model}"
        state = RetryState.start(
            time.monotonic(),
            provision_timeout_s=provision_timeout_s,
            wait_for_capacity=wait_for_capacity,
            max_oom_retries=max_oom_retries,
            server_seen=self._server_seen,
        )
        self._last_retry_count = 0
        try:
            while True:
                read = attempt_timeout(self._read_timeout, state, time.monotonic())
                try:
                    answer = await self._send("POST", path, headers=headers, data=payload, read_timeout=read)
                except _TRANSPORT_ERRORS as exc:
                    outcome: Any = W.judge_transport(
                        _transport_kind(exc),
                        exc,
                        state,
                        time.monotonic(),
                        operation=operation,
                        base_url=self._base_url,
                    )
                else:
                    outcome = W.judge(
                        answer.status,
                        answer.headers,
                        answer.body,
                        state,
                        time.monotonic(),
                        operation=operation,
                        model=model,
                        gpu=gpu,
                        lora=lora,
                    )
                    if isinstance(outcome, dict):
                        return outcome, answer.headers
                await asyncio.sleep(outcome.delay)
        finally:
            self._last_retry_count = state.retries

    # ------------------------------------------------------------ inference

    async def encode(
        self,
        model: str,
        items: Any,
        *,
        output_types: Sequence[str] | None = None,
        instruction: str | None = None,
        output_dtype: str | None = None,
        is_query: bool | None = None,
        options: dict[str, Any] | None = None,
        gpu: str | None = None,
        priority: str | None = None,
        wait_for_capacity: bool = True,
        provision_timeout_s: float | None = None,
        max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES,
    ) -> Any:
        opts = W.merge_options(self._default_options, options)
        body, sent, single = W.encode_body(
            items,
            output_types=output_types,
            instruction=instruction,
            output_dtype=output_dtype,
            is_query=is_query,
            options=opts,
        )
        data, headers = await self._infer(
            "encode",
            model,
            body,
            gpu=gpu,
            priority=priority,
            wait_for_capacity=wait_for_capacity,
            provision_timeout_s=provision_timeout_s,
            max_oom_retries=max_oom_retries,
            lora=opts.get("lora_id") or opts.get("lora"),
        )
        results = W.parse_encode(data, model, sent, headers)
        return results[0] if single else results

    async def score(
        self,
        model: str,
        query: Any,
        items: list[Any],
        *,
        instruction: str | None = None,
        options: dict[str, Any] | None = None,
        gpu: str | None = None,
        priority: str | None = None,
        wait_for_capacity: bool = True,
        provision_timeout_s: float | None = None,
        max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES,
    ) -> dict[str, Any]:
        body = W.score_body(
            query, items, instruction=instruction, options=W.merge_options(self._default_options, options)
        )
        data, headers = await self._infer(
            "score",
            model,
            body,
            gpu=gpu,
            priority=priority,
            wait_for_capacity=wait_for_capacity,
            provision_timeout_s=provision_timeout_s,
            max_oom_retries=max_oom_retries,
        )
        return W.parse_score(data, model, headers)

    async def extract(
        self,
        model: str,
        items: Any,
        *,
        labels: list[str] | None = None,
        output_schema: dict[str, Any] | None = None,
        instruction: str | None = None,
        options: dict[str, Any] | None = None,
        gpu: str | None = None,
        priority: str | None = None,
        wait_for_capacity: bool = True,
        provision_timeout_s: float | None = None,
        max_oom_retries: int = RESOURCE_EXHAUSTED_MAX_RETRIES,
    ) -> Any:
        body, sent, single = W.extract_body(
            items,
            labels=labels,
            output_schema=output_schema,
            instruction=instruction,
            options=W.merge_options(self._default_options, options),
        )
        data, headers = await self._infer(
            "extract",
            model,
            body,
            gpu=gpu,
            priority=priority,
            wait_for_capacity=wait_for_capacity,
            provision_timeout_s=provision_timeout_s,
            max_oom_retries=max_oom_retries,
        )
        results = W.parse_extract(data, model, sent, headers)
        return results[0] if single else results

    async def tokenize(
        self,
        model: str,
        items: Any,
        *,
        options: dict[str, Any] | None = None,
        gpu: str | None = None,
        priority: str | None = None,
        wait_for_capacity: bool = True,
        provision_timeout_s: float | None = None,
    ) -> Any:
        """The model's own tokenizer over one item or a list: ``tokens``, ``ids``, ``offsets``
        (character spans) and ``count`` per item (``options={"add_special_tokens": False}`` to
        leave out [CLS]/[SEP] and the like)."""
        body, sent, single = W.tokenize_body(items, options=W.merge_options(self._default_options, options))
        data, headers = await self._infer(
            "tokenize",
            model,
            body,
            gpu=gpu,
            priority=priority,
            wait_for_capacity=wait_for_capacity,
            provision_timeout_s=provision_timeout_s,
            max_oom_retries=0,
        )
        results = W.parse_tokenize(data, model, sent, headers)
        return results[0] if single else results

    # ------------------------------------------------------------ models and capacity

    async def _json(
        self, method: str, path: str, *, what: str, model: str | None = None, body: bytes | None = None
    ) -> dict[str, Any]:
        headers = W.JSON_BODY_HEADERS if body is not None else W.JSON_HEADERS
        answer = await self._simple(method, path, headers=headers, data=body)
        if answer.status >= 300:
            raise W.terminal_error(W.ErrorInfo(answer.status, answer.headers, answer.body), model=model)
        return W.decode_json_object(answer.body, what=what, status=answer.status)

    async def list_models(self) -> list[dict[str, Any]]:
        return W.models_list(await self._json("GET", "/v1/models", what="models"))

    async def get_model(self, model: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/models/{model}", what="model", model=model)

    async def get_capacity(self, *, gpu: str | None = None) -> dict[str, Any]:
        return W.parse_capacity(await self._json("GET", "/health", what="health"), gpu)

    # ------------------------------------------------------------ status

    async def _is_gateway(self) -> bool:
        try:
            answer = await self._simple("GET", "/health", headers=W.JSON_HEADERS)
        except SIEConnectionError:
            return False
        try:
            return answer.status == 200 and S.is_gateway(
                W.decode_json_object(answer.body, what="health", status=answer.status)
            )
        except SIEError:
            return False

    async def watch(self, *, mode: S.WatchMode = "auto") -> AsyncIterator[dict[str, Any]]:
        """Async twin of :meth:`sdk.SIEClient.watch`."""
        path = S.watch_path(mode, await self._is_gateway() if mode == "auto" else None)
        async for frame in S.watch_async(
            S.ws_url(self._base_url, path), self._headers, self._connect_timeout
        ):
            yield frame

    async def wait_for_capacity(
        self,
        gpu: str,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        poll_interval_s: float = 5.0,
    ) -> dict[str, Any]:
        """Async twin of :meth:`sdk.SIEClient.wait_for_capacity`."""
        if model:
            await self.encode(
                model, {"text": "warmup"}, gpu=gpu, wait_for_capacity=True, provision_timeout_s=timeout_s
            )
            return await self.get_capacity(gpu=gpu)
        state = S.capacity_state(time.monotonic(), timeout_s, server_seen=self._server_seen)
        while True:
            failed: tuple[Transport, BaseException] | None = None
            try:
                capacity = await self.get_capacity(gpu=gpu)
                if capacity.get("worker_count", 0) > 0:
                    return capacity
            except SIEConnectionError as exc:
                cause = exc.__cause__
                failed = (_transport_kind(cause) if cause is not None else Transport.FATAL, exc)
            except RequestError:
                pass  # not a gateway yet: keep waiting
            await asyncio.sleep(
                S.capacity_wait(
                    failed,
                    state,
                    time.monotonic(),
                    gpu=gpu,
                    poll_interval_s=poll_interval_s,
                    base_url=self._base_url,
                )
            )

    # ------------------------------------------------------------ pools

    async def create_pool(
        self,
        name: str,
        gpus: dict[str, int] | None = None,
        gpu_caps: dict[str, int] | None = None,
        bundle: str | None = None,
        minimum_worker_count: int | None = None,
        pinned_models: list[str] | None = None,
        *,
        queue_pool: str | None = None,
    ) -> None:
        """Create (or update) a pool; a task in this event loop renews its lease."""
        body = P.create_body(
            name,
            gpus=gpus,
            gpu_caps=gpu_caps,
            bundle=bundle,
            minimum_worker_count=minimum_worker_count,
            pinned_models=pinned_models,
            queue_pool=queue_pool,
        )
        answer = await self._simple(
            "POST",
            "/v1/pools",
            headers={**W.JSON_BODY_HEADERS, **self._admin_headers},
            data=W.json_bytes(body),
        )
        P.created(name, answer.status, answer.body)
        if name not in self._renewers and not self._closed:
            renewer = P.TaskRenewer(name, lambda: self._renew(name), self.lease_renewal_interval_s)
            self._renewers[name] = renewer
            renewer.start()

    async def _renew(self, name: str) -> bool:
        answer = await self._simple(
            "POST", f"/v1/pools/{name}/renew", headers={**W.JSON_HEADERS, **self._admin_headers}
        )
        return answer.status < 400

    async def get_pool(self, name: str) -> dict[str, Any] | None:
        answer = await self._simple("GET", f"/v1/pools/{name}", headers=W.JSON_HEADERS)
        return P.info(name, answer.status, answer.body)

    async def delete_pool(self, name: str) -> bool:
        renewer = self._renewers.pop(name, None)
        if renewer is not None:
            await renewer.stop()
        answer = await self._simple(
            "DELETE", f"/v1/pools/{name}", headers={**W.JSON_HEADERS, **self._admin_headers}
        )
        return P.deleted(name, answer.status, answer.body)

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        renewers = list(self._renewers.values())
        self._renewers.clear()
        for renewer in renewers:
            await renewer.stop()
        self._closed = True
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
