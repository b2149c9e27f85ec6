"""Checks of the rerank routes (Cohere v1/v2 through the real ``cohere`` client, TEI over HTTP)
against the native score route of the same server: ``sie serve`` and the gateway share them."""

from __future__ import annotations

import httpx

QUERY = "what is machine learning"
DOCS = [
    "Python is a snake that lives in warm places",
    "Machine learning is a field of artificial intelligence",
    "The stock market fell on Tuesday",
    "Deep learning is a kind of machine learning",
    "Bananas are yellow",
]


def native_scores(url: str, model: str, query: str, docs: list[str]) -> list[tuple[int, float]]:
    """(index, score) from ``POST /v1/score`` (JSON), in its order (descending score)."""
    resp = httpx.post(
        f"{url}/v1/score/{model}",
        json={"query": {"text": query}, "items": [{"id": str(i), "text": d} for i, d in enumerate(docs)]},
        headers={"Accept": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return [(int(e["item_id"]), float(e["score"])) for e in resp.json()["scores"]]


def check_cohere_clients(url: str, model: str) -> None:
    import cohere

    expected = native_scores(url, model, QUERY, DOCS)
    assert [s for _, s in expected] == sorted((s for _, s in expected), reverse=True)
    v1 = cohere.Client(api_key="unused", base_url=url, timeout=60)
    got = v1.rerank(model=model, query=QUERY, documents=DOCS, top_n=3, return_documents=True)
    assert [(r.index, r.relevance_score) for r in got.results] == expected[:3]
    assert [r.document.text for r in got.results] == [DOCS[i] for i, _ in expected[:3]]
    assert got.id and got.meta is not None and got.meta.api_version.version == "1"
    # documents as objects: ``text`` is what is scored; rank_fields picks and labels fields
    objs = [{"text": d, "source": f"s{i}"} for i, d in enumerate(DOCS)]
    got = v1.rerank(model=model, query=QUERY, documents=objs)
    assert [(r.index, r.relevance_score) for r in got.results] == expected
    assert all(r.document is None for r in got.results)
    labelled = native_scores(url, model, QUERY, [f"text: {d}" for d in DOCS])
    got = v1.rerank(model=model, query=QUERY, documents=objs, rank_fields=["text"])
    assert [(r.index, r.relevance_score) for r in got.results] == labelled

    v2 = cohere.ClientV2(api_key="unused", base_url=url, timeout=60)
    got2 = v2.rerank(model=model, query=QUERY, documents=DOCS, top_n=2)
    assert [(r.index, r.relevance_score) for r in got2.results] == expected[:2]
    got2 = v2.rerank(model=model, query=QUERY, documents=DOCS)
    assert [(r.index, r.relevance_score) for r in got2.results] == expected


def check_cohere_errors(url: str, model: str) -> None:
    import cohere
    from cohere.core.api_error import ApiError

    v2 = cohere.ClientV2(api_key="unused", base_url=url, timeout=60)
    for kwargs, status, code in [
        ({"model": "no/such-model", "documents": DOCS}, 404, "model_not_found"),
        ({"model": model, "documents": []}, 400, "invalid_request"),
        ({"model": model, "documents": DOCS, "top_n": 0}, 400, "invalid_request"),
        ({"model": model, "documents": DOCS, "max_tokens_per_doc": 10}, 400, "unsupported_field"),
    ]:
        try:
            v2.rerank(query=QUERY, **kwargs)
        except ApiError as err:
            assert err.status_code == status, (kwargs, err.body)
            assert err.body["error"]["code"] == code, err.body
        else:
            raise AssertionError(f"no error for {kwargs}")
    resp = httpx.post(f"{url}/v1/rerank", json={"model": model, "query": "q", "documents": ["a"], "bogus": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bogus"
    resp = httpx.post(f"{url}/v1/rerank", content=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()


def check_tei(url: str, model: str) -> None:
    expected = native_scores(url, model, QUERY, DOCS)
    resp = httpx.post(f"{url}/rerank", json={"model": model, "query": QUERY, "texts": DOCS}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert [(r["index"], r["score"]) for r in resp.json()] == expected
    assert all("text" not in r for r in resp.json())
    resp = httpx.post(
        f"{url}/rerank", json={"model": model, "query": QUERY, "texts": DOCS, "return_text": True}, timeout=60
    )
    assert [r["text"] for r in resp.json()] == [DOCS[i] for i, _ in expected]
    # errors in TEI's shape: a message and an error type
    resp = httpx.post(
        f"{url}/rerank", json={"model": model, "query": QUERY, "texts": DOCS, "raw_scores": True}
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["error_type"] == "Validation" and err["code"] == "unsupported_field"
    assert isinstance(err["error"], str) and "raw_scores" in err["error"]
    resp = httpx.post(
        f"{url}/rerank", json={"model": "no-such-model", "query": QUERY, "texts": DOCS}, timeout=60
    )
    assert resp.status_code == 404 and resp.json()["error_type"] == "Validation", resp.text


def check_limit(url: str, model: str, limit: int) -> None:
    """More documents than the score route takes: the same 400."""
    docs = [f"doc {i}" for i in range(limit + 1)]
    for path, body in [
        ("/v1/rerank", {"model": model, "query": "q", "documents": docs}),
        ("/v2/rerank", {"model": model, "query": "q", "documents": docs}),
        ("/rerank", {"model": model, "query": "q", "texts": docs}),
    ]:
        resp = httpx.post(url + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, resp.text)
        # TEI's shape on its route, the OpenAI envelope on Cohere's
        err = resp.json() if path == "/rerank" else resp.json()["error"]
        message = err["error"] if path == "/rerank" else err["message"]
        assert err["param"] == ("texts" if path == "/rerank" else "documents")
        assert "documents" in message or "texts" in message
