"""The framework integrations against a running ``sie serve`` (the deterministic ``sie-fake`` model:
dense 384 and a score task): LangChain's own standard embeddings tests for ``SIEEmbeddings``, the
LangChain and LlamaIndex rerankers, and the Haystack embedders and ranker — rankings and vectors
equal what the SDK's ``score`` and ``encode`` give for the same inputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("langchain_tests")
pytest.importorskip("haystack")
pytest.importorskip("llama_index.core")

from haystack import Document as HaystackDocument  # noqa: E402
from haystack import Pipeline  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_tests.integration_tests import EmbeddingsIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import EmbeddingsUnitTests  # noqa: E402
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode  # noqa: E402

from sdk import SIEClient  # noqa: E402
from sdk.integrations.haystack import SIEDocumentEmbedder, SIERanker, SIETextEmbedder  # noqa: E402
from sdk.integrations.langchain import SIEEmbeddings, SIERerank  # noqa: E402
from sdk.integrations.llamaindex import SIERerank as LlamaRerank  # noqa: E402
from tests.support.serve import ServeProcess  # noqa: E402

FAKE = "sie-fake"
QUERY = "what is machine learning"
TEXTS = [
    "Bananas are yellow",
    "Machine learning is a field of artificial intelligence",
    "The stock market fell on Tuesday",
    "Deep learning is a kind of machine learning",
    "Python is a snake",
]
SERVER: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def server():
    with ServeProcess(env={"SIE_PRELOAD_MODELS": FAKE}) as srv:
        SERVER["url"] = srv.url
        yield srv


def expected_ranking() -> list[tuple[int, float]]:
    with SIEClient(SERVER["url"]) as client:
        result = client.score(FAKE, {"text": QUERY}, [{"id": str(i), "text": t} for i, t in enumerate(TEXTS)])
    return [(int(e["item_id"]), float(e["score"])) for e in result["scores"]]


def expected_vectors(texts: list[str], is_query: bool) -> np.ndarray:
    with SIEClient(SERVER["url"]) as client:
        results = client.encode(FAKE, [{"text": t} for t in texts], is_query=is_query)
    return np.stack([r["dense"] for r in results])


class TestSIEEmbeddingsStandardUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[SIEEmbeddings]:
        return SIEEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": FAKE, "base_url": SERVER["url"]}


class TestSIEEmbeddingsStandardIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[SIEEmbeddings]:
        return SIEEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": FAKE, "base_url": SERVER["url"]}


def test_langchain_rerank():
    docs = [Document(page_content=t, metadata={"n": i}) for i, t in enumerate(TEXTS)]
    reranker = SIERerank(model=FAKE, base_url=SERVER["url"], top_n=3)
    out = reranker.compress_documents(docs, QUERY)
    expected = expected_ranking()[:3]
    assert [(d.metadata["n"], d.metadata["relevance_score"]) for d in out] == expected
    assert [d.page_content for d in out] == [TEXTS[i] for i, _ in expected]
    assert asyncio.run(reranker.acompress_documents(docs, QUERY)) == out
    assert reranker.compress_documents([], QUERY) == []
    reranker.close()


def test_llamaindex_rerank():
    nodes = [NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=0.0) for i, t in enumerate(TEXTS)]
    reranker = LlamaRerank(model=FAKE, base_url=SERVER["url"], top_n=2)
    out = reranker.postprocess_nodes(nodes, query_bundle=QueryBundle(QUERY))
    expected = expected_ranking()[:2]
    assert [(n.node.node_id, n.score) for n in out] == [(f"n{i}", s) for i, s in expected]
    again = asyncio.run(reranker.apostprocess_nodes(nodes, query_str=QUERY))
    assert [(n.node.node_id, n.score) for n in again] == [(n.node.node_id, n.score) for n in out]
    assert LlamaRerank(model=FAKE, base_url=SERVER["url"], top_n=None).postprocess_nodes(
        nodes, query_str=QUERY
    )


def test_haystack_embedders_and_ranker_in_a_pipeline():
    docs = [HaystackDocument(content=t, meta={"n": i}) for i, t in enumerate(TEXTS)]
    embedded = SIEDocumentEmbedder(model=FAKE, base_url=SERVER["url"], batch_size=2).run(docs)["documents"]
    np.testing.assert_allclose(
        np.array([d.embedding for d in embedded]), expected_vectors(TEXTS, False), atol=1e-6
    )
    assert [d.meta["n"] for d in embedded] == list(range(len(TEXTS)))
    query = SIETextEmbedder(model=FAKE, base_url=SERVER["url"]).run(QUERY)
    np.testing.assert_allclose(query["embedding"], expected_vectors([QUERY], True)[0], atol=1e-6)

    pipe = Pipeline()
    pipe.add_component("ranker", SIERanker(model=FAKE, base_url=SERVER["url"], top_k=3))
    ranked = pipe.run({"ranker": {"query": QUERY, "documents": docs}})["ranker"]["documents"]
    assert [(d.meta["n"], d.score) for d in ranked] == expected_ranking()[:3]
    # components serialise and come back with the same settings
    restored = SIERanker.from_dict(SIERanker(model=FAKE, base_url=SERVER["url"], top_k=3).to_dict())
    assert (restored.model, restored.base_url, restored.top_k) == (FAKE, SERVER["url"], 3)
    loaded = Pipeline.loads(pipe.dumps(), allowed_modules=["sdk.integrations.haystack"])
    assert loaded.get_component("ranker").top_k == 3


def test_langchain_cohere_reranker_against_our_rerank_route():
    """LangChain's own Cohere reranker (``langchain-cohere``), pointed at our URL, works unchanged."""
    langchain_cohere = pytest.importorskip("langchain_cohere")
    reranker = langchain_cohere.CohereRerank(model=FAKE, base_url=SERVER["url"], cohere_api_key="-", top_n=3)
    docs = [Document(page_content=t, metadata={"n": i}) for i, t in enumerate(TEXTS)]
    out = reranker.compress_documents(docs, QUERY)
    assert [(d.metadata["n"], d.metadata["relevance_score"]) for d in out] == expected_ranking()[:3]
