"""LangChain ``Embeddings`` backed by an sie-cluster gateway or ``sie serve`` (extra ``langchain``).

from sdk.integrations.langchain import SIEEmbeddings
emb = SIEEmbeddings(model="sentence-transformers/all-MiniLM-L6-v2", base_url="http://localhost:8080")
emb.embed_query("hello")
"""

from __future__ import annotations

from typing import Any

try:
    from langchain_core.embeddings import Embeddings
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "SIEEmbeddings needs langchain-core: pip install langchain-core "
        "(in the checkout: .venv/bin/pip install -e '.[langchain]')"
    ) from exc

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.integrations._common import batches, encode_kwargs, vectors


class SIEEmbeddings(Embeddings):
    """Dense embeddings through ``SIEClient.encode``; documents and queries are encoded with
    ``is_query`` false and true, so asymmetric models apply the right template."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        gpu: str | None = None,
        options: dict[str, Any] | None = None,
        instruction: str | None = None,
        batch_size: int = 64,
        client: SIEClient | None = None,
        async_client: SIEAsyncClient | None = None,
        **client_kwargs: Any,
    ) -> None:
        self.model = model
        self.gpu = gpu
        self.options = options
        self.instruction = instruction
        self.batch_size = batch_size
        self._base_url = base_url
        self._api_key = api_key
        self._client_kwargs = client_kwargs
        self._client = client
        self._async_client = async_client

    @property
    def client(self) -> SIEClient:
        if self._client is None:
            self._client = SIEClient(self._base_url, api_key=self._api_key, **self._client_kwargs)
        return self._client

    @property
    def async_client(self) -> SIEAsyncClient:
        if self._async_client is None:
            self._async_client = SIEAsyncClient(self._base_url, api_key=self._api_key, **self._client_kwargs)
        return self._async_client

    def _kwargs(self, is_query: bool) -> dict[str, Any]:
        return encode_kwargs(
            is_query=is_query, instruction=self.instruction, options=self.options, gpu=self.gpu
        )

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        out: list[list[float]] = []
        for batch in batches(texts, self.batch_size):
            out.extend(vectors(self.client.encode(self.model, batch, **self._kwargs(False))))
        return out

    def embed_query(self, text: str) -> list[float]:
        return vectors(self.client.encode(self.model, [{"text": text}], **self._kwargs(True)))[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        out: list[list[float]] = []
        for batch in batches(texts, self.batch_size):
            out.extend(vectors(await self.async_client.encode(self.model, batch, **self._kwargs(False))))
        return out

    async def aembed_query(self, text: str) -> list[float]:
        return vectors(await self.async_client.encode(self.model, [{"text": text}], **self._kwargs(True)))[0]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        if self._async_client is not None:
            await self._async_client.close()
