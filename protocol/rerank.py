"""The rerank routes other servers answer, for every front door: Cohere's ``POST /v1/rerank`` and
``POST /v2/rerank``, and Text Embeddings Inference's ``POST /rerank``.

Each is a ``score`` call in another shape: the documents become the score items (ids ``"0"``,
``"1"``, … — their positions), the query the score query, and the answer lists the score entries
by descending score (ties in input order), cut to ``top_n``. The scores are the score route's.

Cohere request: ``model``, ``query``, ``documents`` (strings, or objects whose ``rank_fields`` — or
``text``, or else every field — are joined as ``key: value`` lines), ``top_n``, ``return_documents``
(v1; also accepted on v2), ``rank_fields``; ``priority`` is accepted and does not reorder anything
(priority classes come from ``X-SIE-Priority``); ``max_tokens_per_doc``, ``max_chunks_per_doc``
and enabled ``relevant_spans`` are refused (400 ``unsupported_field``); ``options`` (SIE's score
options, ``profile`` included) is an extension. Answer:
``{id, results: [{index, relevance_score, document?}], meta}``.

TEI request: ``query``, ``texts``, ``return_text``, ``raw_scores`` (true is refused: the score path
returns the model's activated score, which is what TEI returns by default), ``truncate`` and
``truncation_direction`` (inputs are cut to the model's window from the right, as on the score
route; ``Left`` is refused), and ``model`` as an extension (default: the server's
``rerank_default_model`` setting). Answer: ``[{index, score, text?}]``.

Unknown fields and bad values are 400 (the OpenAI error envelope, as on ``/v1/embeddings``, on
Cohere's routes; TEI's error shape on TEI's: iokit.http ``rerank_error_response``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from protocol.api import Item, parse_request
from protocol.errors import SIEError, invalid_input

RerankKind = Literal["cohere-v1", "cohere-v2", "tei"]
ROUTES: dict[str, RerankKind] = {"/v1/rerank": "cohere-v1", "/v2/rerank": "cohere-v2", "/rerank": "tei"}


class RelevantSpans(BaseModel):
    model_config = ConfigDict(extra="allow")

    mode: str = "disabled"


class CohereRerankRequest(BaseModel):
    """The body of Cohere's ``POST /v1/rerank`` and ``POST /v2/rerank``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "sie-fake", "query": "what is ML", "documents": ["ML is AI", "a cat"], "top_n": 1}
            ]
        },
    )

    model: str = Field(min_length=1)
    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    rank_fields: list[str] | None = None
    return_documents: bool = False
    priority: int | None = None
    max_tokens_per_doc: int | None = None
    max_chunks_per_doc: int | None = None
    relevant_spans: RelevantSpans | None = None
    options: dict[str, Any] | None = None


class TeiRerankRequest(BaseModel):
    """The body of Text Embeddings Inference's ``POST /rerank`` (plus ``model``)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"model": "sie-fake", "query": "what is ML", "texts": ["ML is AI", "a cat"]}]
        },
    )

    query: str
    texts: list[str] = Field(min_length=1)
    return_text: bool = False
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["Left", "Right", "left", "right"] | None = None
    model: str | None = Field(default=None, min_length=1)


class CohereRerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class CohereRerankResponse(BaseModel):
    id: str
    results: list[CohereRerankResult]
    meta: dict[str, Any]


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class TeiRerankResponse(RootModel[list[TeiRank]]):
    """TEI's answer: a bare list, by descending score."""


@dataclass(frozen=True)
class RerankCall:
    """A parsed rerank request, whatever its shape: what to score and how to answer."""

    kind: RerankKind
    model: str
    query: str
    texts: list[str]
    originals: list[Any]  # the documents as sent (for return_documents)
    top_n: int | None
    return_documents: bool
    options: dict[str, Any]

    def query_item(self) -> Item:
        return Item(text=self.query)

    def score_items(self) -> list[Item]:
        return [Item(id=str(i), text=t) for i, t in enumerate(self.texts)]


def _unsupported(field: str, message: str) -> None:
    raise invalid_input(message, param=field, openai_code="unsupported_field")


def document_text(doc: str | dict[str, Any], rank_fields: list[str] | None, index: int) -> str:
    """The text a document is scored by: a string as is; an object's ``rank_fields`` (else its
    ``text``, else all its fields) as ``key: value`` lines."""
    if isinstance(doc, str):
        return doc
    param = f"documents.{index}"
    for key, value in doc.items():
        if not isinstance(value, str):
            raise invalid_input(f"Field '{param}.{key}': document fields must be strings", param=param)
    if rank_fields:
        missing = [f for f in rank_fields if f not in doc]
        if missing:
            raise invalid_input(
                f"Field '{param}': no field {missing[0]!r} (named in rank_fields)", param=param
            )
        return "\n".join(f"{f}: {doc[f]}" for f in rank_fields)
    if "text" in doc:
        return str(doc["text"])
    if not doc:
        raise invalid_input(f"Field '{param}': an empty document object", param=param)
    return "\n".join(f"{k}: {v}" for k, v in doc.items())


def parse_cohere(data: Any, kind: RerankKind) -> RerankCall:
    req = parse_request(CohereRerankRequest, data)
    if req.max_tokens_per_doc is not None:
        _unsupported(
            "max_tokens_per_doc",
            "max_tokens_per_doc is not supported (documents are cut to the model's window)",
        )
    if req.max_chunks_per_doc is not None:
        _unsupported("max_chunks_per_doc", "max_chunks_per_doc is not supported")
    if req.relevant_spans is not None and req.relevant_spans.mode != "disabled":
        _unsupported("relevant_spans", "relevant_spans are not supported")
    texts = [document_text(d, req.rank_fields, i) for i, d in enumerate(req.documents)]
    return RerankCall(
        kind=kind,
        model=req.model,
        query=req.query,
        texts=texts,
        originals=list(req.documents),
        top_n=req.top_n,
        return_documents=req.return_documents,
        options=dict(req.options or {}),
    )


def parse_tei(data: Any, default_model: str) -> RerankCall:
    req = parse_request(TeiRerankRequest, data)
    if req.raw_scores:
        _unsupported("raw_scores", "raw_scores is not supported: scores are the model's activated scores")
    if req.truncation_direction is not None and req.truncation_direction.lower() == "left":
        _unsupported("truncation_direction", "truncation_direction 'Left' is not supported")
    model = req.model or default_model
    if not model:
        raise invalid_input("'model' is required (this server has no default rerank model)", param="model")
    return RerankCall(
        kind="tei",
        model=model,
        query=req.query,
        texts=list(req.texts),
        originals=list(req.texts),
        top_n=None,
        return_documents=req.return_text,
        options={},
    )


def parse(path: str, data: Any, *, default_model: str) -> RerankCall:
    """The request of the rerank route at ``path`` (one of :data:`ROUTES`)."""
    kind = ROUTES[path]
    if kind == "tei":
        return parse_tei(data, default_model)
    return parse_cohere(data, kind)


def in_request_terms(err: SIEError, kind: RerankKind) -> SIEError:
    """A score-path error as the rerank request would name it: the score ``items`` are the
    ``documents`` (Cohere) or ``texts`` (TEI), the score ``query`` item is ``query``."""
    if err.param is None:
        return err
    head, _, rest = err.param.partition(".")
    if head == "items":
        name = "texts" if kind == "tei" else "documents"
        err.param = f"{name}.{rest}" if rest else name
        err.message = err.message.replace("items", name)
    elif head == "query" and rest:
        err.param = "query"
    return err


def ranking(entries: Any, count: int) -> list[tuple[int, float]]:
    """(document index, score) by descending score, ties in input order, from a score result's
    entries (``{item_id, score, ...}`` with the ids :meth:`RerankCall.score_items` gave)."""
    if isinstance(entries, dict):
        entries = entries.get("scores") or []
    out: list[tuple[int, float]] = []
    for e in entries or []:
        index = int(e["item_id"])
        if not 0 <= index < count:
            raise ValueError(f"score entry for unknown item {e['item_id']!r}")
        out.append((index, float(e["score"])))
    out.sort(key=lambda p: (-p[1], p[0]))
    return out


def answer(
    call: RerankCall, ranked: list[tuple[int, float]], request_id: str, input_tokens: int | None
) -> Any:
    """The response body of ``call``'s route."""
    top = ranked[: call.top_n] if call.top_n is not None else ranked
    if call.kind == "tei":
        rows: list[dict[str, Any]] = []
        for index, score in top:
            row: dict[str, Any] = {"index": index, "score": score}
            if call.return_documents:
                row["text"] = call.texts[index]
            rows.append(row)
        return rows
    results = []
    for index, score in top:
        row = {"index": index, "relevance_score": score}
        if call.return_documents:
            doc = call.originals[index]
            row["document"] = {"text": doc} if isinstance(doc, str) else doc
        results.append(row)
    meta: dict[str, Any] = {
        "api_version": {"version": "1" if call.kind == "cohere-v1" else "2"},
        "billed_units": {"search_units": 1},
    }
    if input_tokens is not None:
        meta["tokens"] = {"input_tokens": int(input_tokens), "output_tokens": 0}
    return {"id": request_id, "results": results, "meta": meta}
