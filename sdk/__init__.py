"""Python client for sie-cluster (and any server that speaks the SIE wire contract).

``SIEClient`` (sync, httpx) and ``SIEAsyncClient`` (async, aiohttp) have the call
signatures and result shapes of the public ``sie-sdk``; the exceptions have its names.
"""

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.errors import (
    IncompleteBatchError,
    InputTooLongError,
    LoraLoadingError,
    ModelLoadFailedError,
    ModelLoadingError,
    PoolError,
    ProvisioningError,
    RateLimitError,
    RequestError,
    ResourceExhaustedError,
    ServerError,
    SIEConnectionError,
    SIEError,
)

__all__ = [
    "IncompleteBatchError",
    "InputTooLongError",
    "LoraLoadingError",
    "ModelLoadFailedError",
    "ModelLoadingError",
    "PoolError",
    "ProvisioningError",
    "RateLimitError",
    "RequestError",
    "ResourceExhaustedError",
    "SIEAsyncClient",
    "SIEClient",
    "SIEConnectionError",
    "SIEError",
    "ServerError",
]
