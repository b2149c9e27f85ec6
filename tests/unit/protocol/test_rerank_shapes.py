"""The rerank request shapes (Cohere, TEI) and their answers, without a server."""

from __future__ import annotations

import pytest

from protocol import rerank
from protocol.errors import SIEError


def test_documents_as_objects():
    assert rerank.document_text("plain", None, 0) == "plain"
    assert rerank.document_text({"text": "t", "title": "x"}, None, 0) == "t"
    assert rerank.document_text({"title": "x", "body": "y"}, None, 0) == "title: x\nbody: y"
    assert rerank.document_text({"title": "x", "body": "y"}, ["body"], 0) == "body: y"
    with pytest.raises(SIEError) as err:
        rerank.document_text({"title": "x"}, ["body"], 3)
    assert err.value.param == "documents.3"
    with pytest.raises(SIEError):
        rerank.document_text({"n": 1}, None, 0)  # type: ignore[dict-item]


def test_ranking_sorts_with_ties_in_input_order_and_answers_top_n():
    entries = {
        "scores": [
            {"item_id": "2", "score": 0.5},
            {"item_id": "0", "score": 0.9},
            {"item_id": "1", "score": 0.5},
        ]
    }
    ranked = rerank.ranking(entries, 3)
    assert ranked == [(0, 0.9), (1, 0.5), (2, 0.5)]
    call = rerank.parse("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "b", "c"], "top_n": 2,
                                        "return_documents": True}, default_model="")  # fmt: skip
    body = rerank.answer(call, ranked, "rid", 7)
    assert [r["index"] for r in body["results"]] == [0, 1]
    assert body["results"][0]["document"] == {"text": "a"} and body["meta"]["tokens"]["input_tokens"] == 7
    tei = rerank.parse("/rerank", {"query": "q", "texts": ["a", "b", "c"]}, default_model="m")
    assert tei.model == "m" and rerank.answer(tei, ranked, "rid", None)[0] == {"index": 0, "score": 0.9}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": "q", "documents": ["a"]}, "model"),
        ("/v1/rerank", {"model": "m", "query": "q", "documents": []}, "documents"),
        ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"], "extra": 1}, "extra"),
        (
            "/v2/rerank",
            {"model": "m", "query": "q", "documents": ["a"], "max_tokens_per_doc": 5},
            "max_tokens_per_doc",
        ),
        (
            "/v1/rerank",
            {"model": "m", "query": "q", "documents": ["a"], "max_chunks_per_doc": 5},
            "max_chunks_per_doc",
        ),
        ("/rerank", {"query": "q", "texts": ["a"]}, "model"),
        ("/rerank", {"query": "q", "texts": ["a"], "model": "m", "raw_scores": True}, "raw_scores"),
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "model": "m", "truncation_direction": "Left"},
            "truncation_direction",
        ),
        ("/rerank", {"query": 3, "texts": ["a"], "model": "m"}, "query"),
    ],
)
def test_bad_requests_name_the_field(path, body, param):
    with pytest.raises(SIEError) as err:
        rerank.parse(path, body, default_model="")
    assert err.value.status == 400 and err.value.param == param
