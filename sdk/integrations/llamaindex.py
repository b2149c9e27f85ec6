"""LlamaIndex embedding model and reranking node postprocessor backed by an sie-cluster gateway or
``sie serve`` (extra ``llamaindex``).

from sdk.integrations.llamaindex import SIEEmbedding, SIERerank
embed_model = SIEEmbedding(model_name="sentence-transformers/all-MiniLM-L6-v2", base_url="http://localhost:8080")
rerank = SIERerank(model="BAAI/bge-reranker-base", base_url="http://localhost:8080", top_n=3)
"""

from __future__ import annotations

from typing import Any

from sdk.integrations._common import Backend, missing_extra

try:
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("SIEEmbedding and SIERerank", "llama-index-core", "llamaindex") from exc

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.types import Options

_URL = "gateway or sie serve URL (else SIE_BASE_URL)"
_GPU = "machine profile, or pool/profile"


class SIEEmbedding(BaseEmbedding):
    """Dense embeddings through the SDK; LlamaIndex does the batching (``embed_batch_size``)."""

    base_url: str | None = Field(default=None, description=_URL)
    gpu: str | None = Field(default=None, description=_GPU)
    options: Options | None = Field(default=None, description="encode options (e.g. a profile)")
    instruction: str | None = Field(default=None, description="instruction for instruction-tuned models")

    _backend: Backend = PrivateAttr()

    def __init__(
        self,
        model_name: str,
        *,
        api_key: str | None = None,
        client: SIEClient | None = None,
        async_client: SIEAsyncClient | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_name=model_name, **kwargs)
        self._backend = Backend(
            model_name,
            self.base_url,
            api_key,
            self.gpu,
            self.options,
            self.instruction,
            {},
            client,
            async_client,
        )

    @classmethod
    def class_name(cls) -> str:
        return "SIEEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._backend.embed([query], is_query=True)[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._backend.embed(texts, is_query=False)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await self._backend.aembed([query], is_query=True))[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._aget_text_embeddings([text]))[0]

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await self._backend.aembed(texts, is_query=False)

    def close(self) -> None:
        """Release the connections of the SDK clients this model opened."""
        self._backend.close()

    async def aclose(self) -> None:
        await self._backend.aclose()


class SIERerank(BaseNodePostprocessor):
    """A LlamaIndex node postprocessor that reranks with a score model through ``SIEClient.score``:
    the ``top_n`` best nodes, best first, each with the model's score."""

    model: str = Field(description="a model with a score task")
    top_n: int | None = Field(default=3, description="how many nodes to keep (None: all)")
    base_url: str | None = Field(default=None, description=_URL)
    gpu: str | None = Field(default=None, description=_GPU)
    options: Options | None = Field(default=None, description="score options (e.g. a profile)")

    _backend: Backend = PrivateAttr()

    def __init__(self, *, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._backend = Backend(self.model, self.base_url, api_key, self.gpu, self.options)

    @classmethod
    def class_name(cls) -> str:
        return "SIERerank"

    @staticmethod
    def _texts(nodes: list[NodeWithScore], query_bundle: QueryBundle | None) -> tuple[str, list[str]]:
        if query_bundle is None:
            raise ValueError("SIERerank needs a query")
        texts = [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
        return query_bundle.query_str, texts

    @staticmethod
    def _ranked(nodes: list[NodeWithScore], ranked: list[tuple[int, float]]) -> list[NodeWithScore]:
        return [NodeWithScore(node=nodes[i].node, score=score) for i, score in ranked]

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        return self._ranked(nodes, self._backend.rank(*self._texts(nodes, query_bundle), self.top_n))

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        return self._ranked(nodes, await self._backend.arank(*self._texts(nodes, query_bundle), self.top_n))

    def close(self) -> None:
        """Release the connections of the SDK clients this reranker opened."""
        self._backend.close()

    async def aclose(self) -> None:
        await self._backend.aclose()
