"""Haystack components backed by an sie-cluster gateway or ``sie serve`` (extra ``haystack``): a text
embedder (queries), a document embedder and a ranker.

from sdk.integrations.haystack import SIEDocumentEmbedder, SIERanker, SIETextEmbedder
pipeline.add_component("embedder", SIETextEmbedder(model="sentence-transformers/all-MiniLM-L6-v2",
                                                   base_url="http://localhost:8080"))
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

try:
    from haystack import Document, component, default_from_dict, default_to_dict
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The Haystack components need haystack-ai: pip install haystack-ai "
        "(in the checkout: .venv/bin/pip install -e '.[haystack]')"
    ) from exc

from sdk.client import SIEClient
from sdk.integrations._common import batches, encode_kwargs, ranking, score_call, vectors


class _SIEComponent:
    """The settings every component keeps, its lazy client, and (de)serialisation."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        gpu: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.base_url = base_url
        self.api_key = api_key
        self.gpu = gpu
        self.options = options
        self._client: SIEClient | None = None

    def _init_parameters(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "base_url": self.base_url,
            "gpu": self.gpu,
            "options": self.options,
        }  # the API key is not written out; pass it again (or set SIE_API_KEY)

    def to_dict(self) -> dict[str, Any]:
        return default_to_dict(self, **self._init_parameters())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return default_from_dict(cls, data)

    @property
    def client(self) -> SIEClient:
        if self._client is None:
            self._client = SIEClient(self.base_url, api_key=self.api_key)
        return self._client


@component
class SIETextEmbedder(_SIEComponent):
    """Embeds one text as a query (``is_query`` true): ``{"embedding": [...], "meta": {...}}``."""

    def __init__(self, model: str, *, instruction: str | None = None, **kwargs: Any) -> None:
        _SIEComponent.__init__(self, model, **kwargs)
        self.instruction = instruction

    def _init_parameters(self) -> dict[str, Any]:
        return {**_SIEComponent._init_parameters(self), "instruction": self.instruction}

    @component.output_types(embedding=list[float], meta=dict[str, Any])
    def run(self, text: str) -> dict[str, Any]:
        if not isinstance(text, str):
            raise TypeError("SIETextEmbedder expects a string; use SIEDocumentEmbedder for documents")
        kwargs = encode_kwargs(
            is_query=True, instruction=self.instruction, options=self.options, gpu=self.gpu
        )
        (embedding,) = vectors(self.client.encode(self.model, [{"text": text}], **kwargs))
        return {"embedding": embedding, "meta": {"model": self.model}}


@component
class SIEDocumentEmbedder(_SIEComponent):
    """Embeds documents (``is_query`` false) in batches; each document comes back with ``embedding``."""

    def __init__(
        self, model: str, *, instruction: str | None = None, batch_size: int = 64, **kwargs: Any
    ) -> None:
        _SIEComponent.__init__(self, model, **kwargs)
        self.instruction = instruction
        self.batch_size = batch_size

    def _init_parameters(self) -> dict[str, Any]:
        return {
            **_SIEComponent._init_parameters(self),
            "instruction": self.instruction,
            "batch_size": self.batch_size,
        }

    @component.output_types(documents=list[Document], meta=dict[str, Any])
    def run(self, documents: list[Document]) -> dict[str, Any]:
        if not isinstance(documents, list) or not all(isinstance(d, Document) for d in documents):
            raise TypeError("SIEDocumentEmbedder expects a list of Documents; use SIETextEmbedder for a text")
        kwargs = encode_kwargs(
            is_query=False, instruction=self.instruction, options=self.options, gpu=self.gpu
        )
        embeddings: list[list[float]] = []
        for batch in batches([d.content or "" for d in documents], self.batch_size):
            embeddings.extend(vectors(self.client.encode(self.model, batch, **kwargs)))
        out = [replace(d, embedding=e) for d, e in zip(documents, embeddings, strict=True)]
        return {"documents": out, "meta": {"model": self.model}}


@component
class SIERanker(_SIEComponent):
    """Ranks documents against a query with a score model: the ``top_k`` best, best first, each
    with ``score``."""

    def __init__(self, model: str, *, top_k: int | None = 10, **kwargs: Any) -> None:
        _SIEComponent.__init__(self, model, **kwargs)
        self.top_k = top_k

    def _init_parameters(self) -> dict[str, Any]:
        return {**_SIEComponent._init_parameters(self), "top_k": self.top_k}

    @component.output_types(documents=list[Document])
    def run(self, query: str, documents: list[Document], top_k: int | None = None) -> dict[str, Any]:
        if not documents:
            return {"documents": []}
        q, items, kwargs = score_call(
            query, [d.content or "" for d in documents], options=self.options, gpu=self.gpu
        )
        ranked = ranking(
            self.client.score(self.model, q, items, **kwargs), top_k if top_k is not None else self.top_k
        )
        out = [replace(documents[i], score=score) for i, score in ranked]
        return {"documents": out}
