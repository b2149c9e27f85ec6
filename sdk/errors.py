"""Typed exceptions raised by the SDK clients.

The class names, the hierarchy and the constructor keywords follow the public ``sie-sdk``
so that ``except`` clauses move between the two unchanged. Every class also carries
``message``, ``code`` and ``status_code`` (``None`` where the failure had no HTTP answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sdk.types import RequestMeta


class SIEError(Exception):
    """Base class of every SDK error."""

    code: str | None = None
    status_code: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, code={self.code!r}, status_code={self.status_code!r})"
        )


class SIEConnectionError(SIEError):
    """The server could not be reached, or it did not answer in time."""


class _Answered(SIEError):
    """What an error answer said besides its message: the parameter it blames, the request's
    metadata (``X-SIE-Request-ID``, usage) and, where the server gave one, its ``Retry-After``."""

    param: str | None = None
    request: RequestMeta | None = None
    retry_after: float | None = None

    def __init__(self, message: str, code: str | None, status_code: int | None, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.status_code = status_code
        for name, value in details.items():
            setattr(self, name, value)


class RequestError(_Answered):
    """A 4xx answer, an unexpected redirect, or a successful answer the SDK cannot read."""

    def __init__(
        self,
        message: str,
        code: str | None = None,
        status_code: int | None = None,
        *,
        param: str | None = None,
        request: RequestMeta | None = None,
    ) -> None:
        super().__init__(message, code, status_code, param=param, request=request)


class ServerError(_Answered):
    """A 5xx answer that the retry policy does not (or no longer) retry."""

    def __init__(
        self,
        message: str,
        code: str | None = None,
        status_code: int | None = None,
        *,
        param: str | None = None,
        request: RequestMeta | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, code, status_code, param=param, request=request, retry_after=retry_after)


class ProvisioningError(_Answered):
    """No capacity yet: ``wait_for_capacity=False``, or the provisioning budget ran out."""

    code = "PROVISIONING"
    gpu: str | None

    def __init__(
        self,
        message: str,
        *,
        gpu: str | None = None,
        retry_after: float | None = None,
        param: str | None = None,
        request: RequestMeta | None = None,
        status_code: int | None = 503,
    ) -> None:
        details = {"param": param, "request": request, "retry_after": retry_after, "gpu": gpu}
        super().__init__(message, "PROVISIONING", status_code, **details)


class PoolError(SIEError):
    """A pool call failed."""

    def __init__(
        self,
        message: str,
        *,
        pool_name: str | None = None,
        state: str | None = None,
        status_code: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.pool_name = pool_name
        self.state = state
        self.status_code = status_code
        self.code = code


class LoraLoadingError(_Answered):
    """The LoRA adapter was still loading after the bounded number of retries."""

    code = "LORA_LOADING"
    status_code = 503
    lora: str | None
    model: str | None

    def __init__(
        self,
        message: str,
        *,
        lora: str | None = None,
        model: str | None = None,
        request: RequestMeta | None = None,
    ) -> None:
        super().__init__(message, "LORA_LOADING", 503, lora=lora, model=model, request=request)


class ModelLoadingError(_Answered):
    """The model was still loading when the provisioning budget ran out."""

    code = "MODEL_LOADING"
    status_code = 503
    model: str | None

    def __init__(self, message: str, *, model: str | None = None, request: RequestMeta | None = None) -> None:
        super().__init__(message, "MODEL_LOADING", 503, model=model, request=request)


class ModelLoadFailedError(ServerError):
    """``502 MODEL_LOAD_FAILED``: the server gave up loading the model; never retried."""

    model: str | None
    error_class: str | None
    permanent: bool
    attempts: int

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        error_class: str | None = None,
        permanent: bool = True,
        attempts: int = 1,
        param: str | None = None,
        request: RequestMeta | None = None,
    ) -> None:
        details = {"model": model, "error_class": error_class, "permanent": permanent, "attempts": attempts}
        _Answered.__init__(self, message, "MODEL_LOAD_FAILED", 502, param=param, request=request, **details)


class InputTooLongError(RequestError):
    """``400 INPUT_TOO_LONG``: an input does not fit the model and may not be truncated."""

    model: str | None

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        param: str | None = None,
        request: RequestMeta | None = None,
    ) -> None:
        _Answered.__init__(self, message, "INPUT_TOO_LONG", 400, model=model, param=param, request=request)


class RateLimitError(RequestError):
    """``429``: still rate limited when the call's budget was spent."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = "RATE_LIMIT",
        retry_after: float | None = None,
        param: str | None = None,
        request: RequestMeta | None = None,
    ) -> None:
        _Answered.__init__(self, message, code, 429, retry_after=retry_after, param=param, request=request)


class ResourceExhaustedError(ServerError):
    """``503 RESOURCE_EXHAUSTED`` (out of accelerator memory) after the bounded retries."""

    model: str | None
    retries: int

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        retries: int = 0,
        param: str | None = None,
        request: RequestMeta | None = None,
        retry_after: float | None = None,
    ) -> None:
        details = {"model": model, "retries": retries, "retry_after": retry_after}
        _Answered.__init__(self, message, "RESOURCE_EXHAUSTED", 503, param=param, request=request, **details)


class IncompleteBatchError(ServerError):
    """A ``200`` whose ``items`` does not hold exactly one result per input."""

    expected: int
    received: int
    model: str | None
    missing_ids: list[str] | None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        expected: int,
        received: int,
        model: str | None = None,
        missing_ids: list[str] | None = None,
        request: RequestMeta | None = None,
        results: Sequence[Any] | None = None,
    ) -> None:
        details = {"expected": expected, "received": received, "model": model, "missing_ids": missing_ids}
        _Answered.__init__(self, message, code, None, request=request, **details)
        self.results: list[Any] = list(results) if results is not None else []
        self.request_id: str | None = (request or {}).get("id")
