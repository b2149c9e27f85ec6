"""LlamaIndex embedding model and reranking node postprocessor backed by an sie-cluster gateway or
``sie serve`` (extra ``llamaindex``).

from sdk.integrations.llamaindex import SIEEmbedding, SIERerank
embed_model = SIEEmbedding(model_name="sentence-transformers/all-MiniLM-L6-v2", base_url="http://localhost:8080")
rerank = SIERerank(model="BAAI/bge-reranker-base", base_url="http://localhost:8080", top_n=3)
"""

from __future__ import annotations

from typing import Any

try:
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "SIEEmbedding and SIERerank need llama-index-core: pip install llama-index-core "
        "(in the checkout: .venv/bin/pip install -e '.[llamaindex]')"
    ) from exc

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.integrations._common import encode_kwargs, ranking, score_call, vectors


class SIEEmbedding(BaseEmbedding):
    """Dense embeddings through the SDK; LlamaIndex does the batching (``embed_batch_size``)."""

    base_url: str | None = Field(default=None, description="gateway or sie serve URL (else SIE_BASE_URL)")
    gpu: str | None = Field(default=None, description="machine profile, or pool/profile")
    options: dict[str, Any] | None = Field(default=None, description="encode options (e.g. a profile)")
    instruction: str | None = Field(default=None, description="instruction for instruction-tuned models")

    _client: SIEClient | None = PrivateAttr(default=None)
    _async_client: SIEAsyncClient | None = PrivateAttr(default=None)
    _api_key: str | None = PrivateAttr(default=None)

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
        self._api_key = api_key
        self._client = client
        self._async_client = async_client

    @classmethod
    def class_name(cls) -> str:
        return "SIEEmbedding"

    def _sync(self) -> SIEClient:
        if self._client is None:
            self._client = SIEClient(self.base_url, api_key=self._api_key)
        return self._client

    def _async(self) -> SIEAsyncClient:
        if self._async_client is None:
            self._async_client = SIEAsyncClient(self.base_url, api_key=self._api_key)
        return self._async_client

    def _kwargs(self, is_query: bool) -> dict[str, Any]:
        return encode_kwargs(
            is_query=is_query, instruction=self.instruction, options=self.options, gpu=self.gpu
        )

    def _get_query_embedding(self, query: str) -> list[float]:
        return vectors(self._sync().encode(self.model_name, [{"text": query}], **self._kwargs(True)))[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        items = [{"text": t} for t in texts]
        return vectors(self._sync().encode(self.model_name, items, **self._kwargs(False)))

    async def _aget_query_embedding(self, query: str) -> list[float]:
        results = await self._async().encode(self.model_name, [{"text": query}], **self._kwargs(True))
        return vectors(results)[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._aget_text_embeddings([text]))[0]

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        items = [{"text": t} for t in texts]
        return vectors(await self._async().encode(self.model_name, items, **self._kwargs(False)))


class SIERerank(BaseNodePostprocessor):
    """A LlamaIndex node postprocessor that reranks with a score model through ``SIEClient.score``:
    the ``top_n`` best nodes, best first, each with the model's score."""

    model: str = Field(description="a model with a score task")
    top_n: int | None = Field(default=3, description="how many nodes to keep (None: all)")
    base_url: str | None = Field(default=None, description="gateway or sie serve URL (else SIE_BASE_URL)")
    gpu: str | None = Field(default=None, description="machine profile, or pool/profile")
    options: dict[str, Any] | None = Field(default=None, description="score options (e.g. a profile)")

    _client: SIEClient | None = PrivateAttr(default=None)
    _async_client: SIEAsyncClient | None = PrivateAttr(default=None)
    _api_key: str | None = PrivateAttr(default=None)

    def __init__(self, *, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._api_key = api_key

    @classmethod
    def class_name(cls) -> str:
        return "SIERerank"

    def _call(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None) -> tuple[Any, Any, Any]:
        if query_bundle is None:
            raise ValueError("SIERerank needs a query")
        texts = [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
        return score_call(query_bundle.query_str, texts, options=self.options, gpu=self.gpu)

    def _ranked(self, nodes: list[NodeWithScore], result: dict[str, Any]) -> list[NodeWithScore]:
        return [NodeWithScore(node=nodes[i].node, score=score) for i, score in ranking(result, self.top_n)]

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        if self._client is None:
            self._client = SIEClient(self.base_url, api_key=self._api_key)
        q, items, kwargs = self._call(nodes, query_bundle)
        return self._ranked(nodes, self._client.score(self.model, q, items, **kwargs))

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        if self._async_client is None:
            self._async_client = SIEAsyncClient(self.base_url, api_key=self._api_key)
        q, items, kwargs = self._call(nodes, query_bundle)
        return self._ranked(nodes, await self._async_client.score(self.model, q, items, **kwargs))
