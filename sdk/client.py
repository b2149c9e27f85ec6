"""Synchronous client (httpx): ``SIEClient``."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

import httpx

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
from sdk.errors import RequestError, SIEConnectionError


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
        exc,
        (
            httpx.PoolTimeout,
            httpx.WriteTimeout,
            httpx.NetworkError,
            httpx.RemoteProtocolError,
        ),
    ):
        return Transport.RETRYABLE
    return Transport.FATAL


class SIEClient:
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
        options: dict[str, Any] | None = None,
        max_connections: int | None = None,
        base_url_headers: Mapping[str, str] | None = None,
        connect_timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        remote: str | None = None,
        http_client: httpx.Client | None = None,
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
        headers = W.default_headers(self._api_key, remote)
        headers.update(base_url_headers or {})
        self._owns_http = http_client is None
        if http_client is None:
            limits = httpx.Limits(
                max_connections=max_connections or 100, max_keepalive_connections=max_connections or 20
            )
            http_client = httpx.Client(
                timeout=httpx.Timeout(self._read_timeout, connect=self._connect_timeout),
                limits=limits,
                follow_redirects=False,
            )
        self._http = http_client
        self._headers = headers
        self._renewers: dict[str, P.ThreadRenewer] = {}
        self._lock = threading.Lock()
        self._last_retry_count = 0
        self._last_model_revision: str | None = None
        self._warned_skew = False
        self._server_seen = False  # an HTTP answer came: a refused connection is then a restart
        self._closed = False

    # ------------------------------------------------------------ properties

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def last_retry_count(self) -> int:
        """How many retries the most recent inference call of this client made."""
        return self._last_retry_count

    @property
    def last_model_revision(self) -> str | None:
        return self._last_model_revision

    # ------------------------------------------------------------ plumbing

    def _timeout(self, read: float) -> httpx.Timeout:
        return httpx.Timeout(
            read, connect=min(self._connect_timeout, read), pool=min(self._connect_timeout, read)
        )

    def _send(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
        read_timeout: float | None = None,
    ) -> httpx.Response:
        if self._closed:
            raise RuntimeError("this SIEClient is closed")
        merged = dict(self._headers)
        merged.update(headers or {})
        response = self._http.request(
            method,
            self._base_url + path,
            headers=merged,
            content=content,
            timeout=self._timeout(read_timeout or self._read_timeout),
        )
        self._observe(response.headers)
        return response

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

    def _simple(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One attempt of a non-inference call; transport failures become SIEConnectionError."""
        try:
            return self._send(method, path, **kw)
        except httpx.TransportError as exc:
            raise SIEConnectionError(f"{method} {self._base_url}{path} failed: {exc!r}") from exc

    def _infer(
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
                    response = self._send("POST", path, headers=headers, content=payload, read_timeout=read)
                except httpx.TransportError as exc:
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
                        response.status_code,
                        response.headers,
                        response.content,
                        state,
                        time.monotonic(),
                        operation=operation,
                        model=model,
                        gpu=gpu,
                        lora=lora,
                    )
                    if isinstance(outcome, dict):
                        return outcome, response.headers
                time.sleep(outcome.delay)
        finally:
            self._last_retry_count = state.retries

    # ------------------------------------------------------------ inference

    def encode(
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
        """Encode one item (returns one result) or a list of items (returns a list)."""
        opts = W.merge_options(self._default_options, options)
        body, sent, single = W.encode_body(
            items,
            output_types=output_types,
            instruction=instruction,
            output_dtype=output_dtype,
            is_query=is_query,
            options=opts,
        )
        data, headers = self._infer(
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

    def score(
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
        """Score ``items`` against ``query``; entries come sorted by descending score."""
        body = W.score_body(
            query, items, instruction=instruction, options=W.merge_options(self._default_options, options)
        )
        data, headers = self._infer(
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

    def extract(
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
        """Extract entities, relations, classes or structured data from one item or a list."""
        body, sent, single = W.extract_body(
            items,
            labels=labels,
            output_schema=output_schema,
            instruction=instruction,
            options=W.merge_options(self._default_options, options),
        )
        data, headers = self._infer(
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

    def tokenize(
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
        data, headers = self._infer(
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

    def _json(
        self, method: str, path: str, *, what: str, model: str | None = None, body: bytes | None = None
    ) -> dict[str, Any]:
        headers = W.JSON_BODY_HEADERS if body is not None else W.JSON_HEADERS
        response = self._simple(method, path, headers=headers, content=body)
        if response.status_code >= 300:
            raise W.terminal_error(
                W.ErrorInfo(response.status_code, response.headers, response.content), model=model
            )
        return W.decode_json_object(response.content, what=what, status=response.status_code)

    def list_models(self) -> list[dict[str, Any]]:
        return W.models_list(self._json("GET", "/v1/models", what="models"))

    def get_model(self, model: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/models/{model}", what="model", model=model)

    def get_capacity(self, *, gpu: str | None = None) -> dict[str, Any]:
        """Cluster capacity from the gateway's ``/health`` (a worker raises ``RequestError``)."""
        return W.parse_capacity(self._json("GET", "/health", what="health"), gpu)

    # ------------------------------------------------------------ status

    def _is_gateway(self) -> bool:
        try:
            response = self._simple("GET", "/health", headers=W.JSON_HEADERS)
        except SIEConnectionError:
            return False
        try:
            return response.status_code == 200 and S.is_gateway(response.json())
        except ValueError:
            return False

    def watch(self, *, mode: S.WatchMode = "auto") -> Iterator[dict[str, Any]]:
        """Status frames from ``/ws/cluster-status`` (gateway) or ``/ws/status`` (worker) until the server
        closes the stream; ``mode="auto"`` asks ``/health`` which one this is."""
        path = S.watch_path(mode, self._is_gateway() if mode == "auto" else None)
        yield from S.watch_sync(S.ws_url(self._base_url, path), self._headers, self._connect_timeout)

    def wait_for_capacity(
        self,
        gpu: str,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        poll_interval_s: float = 5.0,
    ) -> dict[str, Any]:
        """Wait until the gateway has workers of ``gpu``; with ``model``, a warm-up encode (which scales
        up and loads the model) first. Raises ``ProvisioningError`` after ``timeout_s`` (default 900 s)."""
        if model:
            self.encode(
                model, {"text": "warmup"}, gpu=gpu, wait_for_capacity=True, provision_timeout_s=timeout_s
            )
            return self.get_capacity(gpu=gpu)
        state = S.capacity_state(time.monotonic(), timeout_s, server_seen=self._server_seen)
        while True:
            failed: tuple[Transport, BaseException] | None = None
            try:
                capacity = self.get_capacity(gpu=gpu)
                if capacity.get("worker_count", 0) > 0:
                    return capacity
            except SIEConnectionError as exc:
                cause = exc.__cause__
                failed = (
                    _transport_kind(cause) if isinstance(cause, httpx.TransportError) else Transport.FATAL,
                    exc,
                )
            except RequestError:
                pass  # not a gateway yet: keep waiting
            time.sleep(
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

    def create_pool(
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
        response = self._simple(
            "POST",
            "/v1/pools",
            headers={**W.JSON_BODY_HEADERS, **self._admin_headers},
            content=W.json_bytes(body),
        )
        P.created(name, response.status_code, response.content)
        with self._lock:
            if name not in self._renewers and not self._closed:
                renewer = P.ThreadRenewer(name, lambda: self._renew(name), self.lease_renewal_interval_s)
                self._renewers[name] = renewer
                renewer.start()

    def _renew(self, name: str) -> bool:
        response = self._simple(
            "POST", f"/v1/pools/{name}/renew", headers={**W.JSON_HEADERS, **self._admin_headers}
        )
        return response.status_code < 400

    def get_pool(self, name: str) -> dict[str, Any] | None:
        response = self._simple("GET", f"/v1/pools/{name}", headers=W.JSON_HEADERS)
        return P.info(name, response.status_code, response.content)

    def delete_pool(self, name: str) -> bool:
        """Stop renewing and delete the pool; ``False`` when the gateway does not know it."""
        self._stop_renewal(name)
        response = self._simple(
            "DELETE", f"/v1/pools/{name}", headers={**W.JSON_HEADERS, **self._admin_headers}
        )
        return P.deleted(name, response.status_code, response.content)

    def _stop_renewal(self, name: str) -> None:
        with self._lock:
            renewer = self._renewers.pop(name, None)
        if renewer is not None:
            renewer.stop()

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop every lease renewal and release the connections."""
        with self._lock:
            renewers = list(self._renewers.values())
            self._renewers.clear()
        for renewer in renewers:
            renewer.stop()
        if not self._closed:
            self._closed = True
            if self._owns_http:
                self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
