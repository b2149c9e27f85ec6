"""Error codes, their HTTP statuses, and the error envelope of the contract (section 2)."""

from __future__ import annotations

from enum import StrEnum
from types import EllipsisType
from typing import Any


class ErrorCode(StrEnum):
    # worker codes
    INVALID_INPUT = "INVALID_INPUT"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    MODEL_NOT_LOADED = "MODEL_NOT_LOADED"
    LORA_LOADING = "LORA_LOADING"
    MODEL_LOADING = "MODEL_LOADING"
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"
    INFERENCE_ERROR = "INFERENCE_ERROR"
    QUEUE_FULL = "QUEUE_FULL"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INPUT_TOO_LONG = "INPUT_TOO_LONG"
    # gateway codes
    PROVISIONING = "PROVISIONING"
    QUEUE_UNAVAILABLE = "QUEUE_UNAVAILABLE"
    GATEWAY_TIMEOUT = "GATEWAY_TIMEOUT"
    RATE_LIMIT = "RATE_LIMIT"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    NOT_FOUND = "NOT_FOUND"


# Default HTTP status and Retry-After (seconds, None = never) for each code.
_DEFAULTS: dict[ErrorCode, tuple[int, float | None]] = {
    ErrorCode.INVALID_INPUT: (400, None),
    ErrorCode.MODEL_NOT_FOUND: (404, None),
    ErrorCode.MODEL_NOT_LOADED: (503, 5),
    ErrorCode.LORA_LOADING: (503, 1),
    ErrorCode.MODEL_LOADING: (503, 5),
    ErrorCode.MODEL_LOAD_FAILED: (502, None),
    ErrorCode.INFERENCE_ERROR: (500, None),
    ErrorCode.QUEUE_FULL: (503, 1),
    ErrorCode.INTERNAL_ERROR: (500, None),
    ErrorCode.RESOURCE_EXHAUSTED: (503, 5),
    ErrorCode.INPUT_TOO_LONG: (400, None),
    ErrorCode.PROVISIONING: (503, 60),
    ErrorCode.QUEUE_UNAVAILABLE: (503, 5),
    ErrorCode.GATEWAY_TIMEOUT: (504, 5),
    ErrorCode.RATE_LIMIT: (429, 1),
    ErrorCode.UNAUTHORIZED: (401, None),
    ErrorCode.FORBIDDEN: (403, None),
    ErrorCode.NOT_FOUND: (404, None),
}

RETRYABLE_CODES = frozenset(
    {
        ErrorCode.MODEL_LOADING,
        ErrorCode.LORA_LOADING,
        ErrorCode.RESOURCE_EXHAUSTED,
        ErrorCode.QUEUE_FULL,
        ErrorCode.PROVISIONING,
        ErrorCode.MODEL_NOT_LOADED,
    }
)


def default_status(code: str) -> int:
    try:
        return _DEFAULTS[ErrorCode(code)][0]
    except ValueError:
        return 500


def default_retry_after(code: str) -> float | None:
    try:
        return _DEFAULTS[ErrorCode(code)][1]
    except ValueError:
        return None


class SIEError(Exception):
    """An error with a contract code; front doors turn it into the JSON error envelope."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        retry_after: float | None | EllipsisType = ...,  # ...: the code's default
        param: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.status = status if status is not None else default_status(self.code)
        self.retry_after: float | None = (
            default_retry_after(self.code) if isinstance(retry_after, EllipsisType) else retry_after
        )
        if self.code == ErrorCode.MODEL_LOAD_FAILED:
            self.retry_after = None  # the contract forbids Retry-After on a terminal load failure
        self.param = param
        self.extra = extra

    def detail(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.param is not None:
            body["param"] = self.param
        body.update(self.extra)
        return body

    def body(self) -> dict[str, Any]:
        """Native envelope: ``{"detail": {code, message, ...}}``."""
        return {"detail": self.detail()}

    def headers(self) -> dict[str, str]:
        headers = {"X-SIE-Error-Code": self.code}
        if self.retry_after is not None:
            headers["Retry-After"] = format_retry_after(self.retry_after)
        return headers

    def __repr__(self) -> str:
        return f"SIEError({self.code!r}, {self.message!r}, status={self.status})"


def format_retry_after(seconds: float) -> str:
    return str(max(0, int(seconds))) if float(seconds).is_integer() else f"{seconds:.3f}"


def invalid_input(message: str, *, param: str | None = None, **extra: Any) -> SIEError:
    return SIEError(ErrorCode.INVALID_INPUT, message, param=param, **extra)
