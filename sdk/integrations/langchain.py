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

from sdk.integrations._common import Backend, missing_extra

try:
    from langchain_core.callbacks import Callbacks
    from langchain_core.documents import BaseDocumentCompressor, Document
    from langchain_core.embeddings import Embeddings
    from pydantic import ConfigDict, PrivateAttr
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("SIEEmbeddings and SIERerank", "langchain-core", "langchain") from exc

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.types import Options


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
        options: Options | None = None,
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
        self._backend = Backend(
            model, base_url, api_key, gpu, options, instruction, client_kwargs, client, async_client
        )

    @property
    def client(self) -> SIEClient:
        return self._backend.sync()

    @property
    def async_client(self) -> SIEAsyncClient:
        return self._backend.async_()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._backend.embed(texts, is_query=False, batch_size=self.batch_size)

    def embed_query(self, text: str) -> list[float]:
        return self._backend.embed([text], is_query=True)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self._backend.aembed(texts, is_query=False, batch_size=self.batch_size)

    async def aembed_query(self, text: str) -> list[float]:
        return (await self._backend.aembed([text], is_query=True))[0]

    def close(self) -> None:
        self._backend.close()

    async def aclose(self) -> None:
        await self._backend.aclose()


class SIERerank(BaseDocumentCompressor):
    """A LangChain document compressor that reranks with a score model (cross-encoder, ColBERT,
    LLM reranker) through ``SIEClient.score``: the ``top_n`` best documents, best first, each with
    ``metadata["relevance_score"]``."""

    model: str
    base_url: str | None = None
    api_key: str | None = None
    top_n: int | None = 3
    gpu: str | None = None
    options: Options | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    _backend: Backend | None = PrivateAttr(default=None)

    def _model(self) -> Backend:
        if self._backend is None:
            self._backend = Backend(self.model, self.base_url, self.api_key, self.gpu, self.options)
        return self._backend

    @staticmethod
    def _ranked(documents: Sequence[Document], ranked: list[tuple[int, float]]) -> list[Document]:
        return [
            Document(
                page_content=documents[i].page_content,
                metadata={**documents[i].metadata, "relevance_score": score},
                id=documents[i].id,
            )
            for i, score in ranked
        ]

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        ranked = self._model().rank(query, [d.page_content for d in documents], self.top_n)
        return self._ranked(documents, ranked)

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        ranked = await self._model().arank(query, [d.page_content for d in documents], self.top_n)
        return self._ranked(documents, ranked)

    def close(self) -> None:
        self._model().close()

    async def aclose(self) -> None:
        await self._model().aclose()
