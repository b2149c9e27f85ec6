"""LangChain ``Embeddings`` and a reranking document compressor backed by an sie-cluster gateway or
``sie serve`` (extra ``langchain``).

from sdk.integrations.langchain import SIEEmbeddings, SIERerank
emb = SIEEmbeddings(model="sentence-transformers/all-MiniLM-L6-v2", base_url="http://localhost:8080")
emb.embed_query("hello")
rerank = SIERerank(model="BAAI/bge-reranker-base", base_url="http://localhost:8080", top_n=3)
rerank.compress_documents(docs, "what is ML")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from langchain_core.callbacks import Callbacks
    from langchain_core.documents import BaseDocumentCompressor, Document
    from langchain_core.embeddings import Embeddings
    from pydantic import ConfigDict, PrivateAttr
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "SIEEmbeddings and SIERerank need langchain-core: pip install langchain-core "
        "(in the checkout: .venv/bin/pip install -e '.[langchain]')"
    ) from exc

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.integrations._common import batches, encode_kwargs, ranking, score_call, vectors


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


class SIERerank(BaseDocumentCompressor):
    """A LangChain document compressor that reranks with a score model (cross-encoder, ColBERT,
    LLM reranker) through ``SIEClient.score``: the ``top_n`` best documents, best first, each with
    ``metadata["relevance_score"]``."""

    model: str
    base_url: str | None = None
    api_key: str | None = None
    top_n: int | None = 3
    gpu: str | None = None
    options: dict[str, Any] | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    _client: SIEClient | None = PrivateAttr(default=None)
    _async_client: SIEAsyncClient | None = PrivateAttr(default=None)

    def _sync(self) -> SIEClient:
        if self._client is None:
            self._client = SIEClient(self.base_url, api_key=self.api_key)
        return self._client

    def _async(self) -> SIEAsyncClient:
        if self._async_client is None:
            self._async_client = SIEAsyncClient(self.base_url, api_key=self.api_key)
        return self._async_client

    def _ranked(self, documents: Sequence[Document], ranked: list[tuple[int, float]]) -> list[Document]:
        out = []
        for index, score in ranked:
            doc = documents[index]
            out.append(
                Document(
                    page_content=doc.page_content,
                    metadata={**doc.metadata, "relevance_score": score},
                    id=doc.id,
                )
            )
        return out

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        q, items, kwargs = score_call(
            query, [d.page_content for d in documents], options=self.options, gpu=self.gpu
        )
        return self._ranked(
            documents, ranking(self._sync().score(self.model, q, items, **kwargs), self.top_n)
        )

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        q, items, kwargs = score_call(
            query, [d.page_content for d in documents], options=self.options, gpu=self.gpu
        )
        result = await self._async().score(self.model, q, items, **kwargs)
        return self._ranked(documents, ranking(result, self.top_n))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        if self._async_client is not None:
            await self._async_client.close()
