"""Haystack components backed by an sie-cluster gateway or ``sie serve`` (extra ``haystack``): a text
embedder (queries), a document embedder and a ranker.

from sdk.integrations.haystack import SIEDocumentEmbedder, SIERanker, SIETextEmbedder
pipeline.add_component("embedder", SIETextEmbedder(model="sentence-transformers/all-MiniLM-L6-v2",
                                                   base_url="http://localhost:8080"))
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypedDict, Unpack

from sdk.integrations._common import Backend, Settings, missing_extra

try:
    from haystack import Document, component, default_from_dict, default_to_dict
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("The Haystack components", "haystack-ai", "haystack") from exc

from sdk.client import SIEClient
from sdk.types import Options


class _Params(TypedDict, total=False):
    """A component's ``init_parameters`` as Haystack serialises them (never the API key: pass it
    again, or set SIE_API_KEY)."""

    model: str
    base_url: str | None
    gpu: str | None
    options: Options | None
    instruction: str | None
    batch_size: int
    top_k: int | None


class _Meta(TypedDict):
    model: str


class _Embedding(TypedDict):
    embedding: list[float]
    meta: _Meta


class _Documents(TypedDict):
    documents: list[Document]
    meta: _Meta


class _Ranked(TypedDict):
    documents: list[Document]


class _SIEComponent:
    """The settings every component keeps, its lazy client, and (de)serialisation."""

    instruction: str | None = None

    def __init__(self, model: str, **settings: Unpack[Settings]) -> None:
        self.model = model
        self.base_url = settings.get("base_url")
        self.api_key = settings.get("api_key")
        self.gpu = settings.get("gpu")
        self.options = settings.get("options")
        self._backend: Backend | None = None

    def _init_parameters(self) -> _Params:
        return {"model": self.model, "base_url": self.base_url, "gpu": self.gpu, "options": self.options}

    def to_dict(self) -> dict[str, Any]:
        """Haystack's serialised form of the component."""
        return default_to_dict(self, **self._init_parameters())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return default_from_dict(cls, data)

    def _model(self) -> Backend:
        if self._backend is None:
            self._backend = Backend(
                self.model, self.base_url, self.api_key, self.gpu, self.options, self.instruction
            )
        return self._backend

    @property
    def client(self) -> SIEClient:
        return self._model().sync()


@component
class SIETextEmbedder(_SIEComponent):
    """Embeds one text as a query (``is_query`` true): ``{"embedding": [...], "meta": {...}}``."""

    def __init__(self, model: str, *, instruction: str | None = None, **settings: Unpack[Settings]) -> None:
        _SIEComponent.__init__(self, model, **settings)
        self.instruction = instruction

    def _init_parameters(self) -> _Params:
        return {**_SIEComponent._init_parameters(self), "instruction": self.instruction}

    @component.output_types(embedding=list[float], meta=dict[str, Any])  # Haystack's socket type
    def run(self, text: str) -> _Embedding:
        if not isinstance(text, str):
            raise TypeError("SIETextEmbedder expects a string; use SIEDocumentEmbedder for documents")
        (embedding,) = self._model().embed([text], is_query=True)
        return {"embedding": embedding, "meta": {"model": self.model}}


@component
class SIEDocumentEmbedder(_SIEComponent):
    """Embeds documents (``is_query`` false) in batches; each document comes back with ``embedding``."""

    def __init__(
        self,
        model: str,
        *,
        instruction: str | None = None,
        batch_size: int = 64,
        **settings: Unpack[Settings],
    ) -> None:
        _SIEComponent.__init__(self, model, **settings)
        self.instruction = instruction
        self.batch_size = batch_size

    def _init_parameters(self) -> _Params:
        params = _SIEComponent._init_parameters(self)
        return {**params, "instruction": self.instruction, "batch_size": self.batch_size}

    @component.output_types(documents=list[Document], meta=dict[str, Any])  # Haystack's socket type
    def run(self, documents: list[Document]) -> _Documents:
        if not isinstance(documents, list) or not all(isinstance(d, Document) for d in documents):
            raise TypeError("SIEDocumentEmbedder expects a list of Documents; use SIETextEmbedder for a text")
        texts = [d.content or "" for d in documents]
        embeddings = self._model().embed(texts, is_query=False, batch_size=self.batch_size)
        out = [replace(d, embedding=e) for d, e in zip(documents, embeddings, strict=True)]
        return {"documents": out, "meta": {"model": self.model}}


@component
class SIERanker(_SIEComponent):
    """Ranks documents against a query with a score model: the ``top_k`` best, best first, each
    with ``score``."""

    def __init__(self, model: str, *, top_k: int | None = 10, **settings: Unpack[Settings]) -> None:
        _SIEComponent.__init__(self, model, **settings)
        self.top_k = top_k

    def _init_parameters(self) -> _Params:
        return {**_SIEComponent._init_parameters(self), "top_k": self.top_k}

    @component.output_types(documents=list[Document])
    def run(self, query: str, documents: list[Document], top_k: int | None = None) -> _Ranked:
        if not documents:
            return {"documents": []}
        texts = [d.content or "" for d in documents]
        ranked = self._model().rank(query, texts, top_k if top_k is not None else self.top_k)
        return {"documents": [replace(documents[i], score=score) for i, score in ranked]}
