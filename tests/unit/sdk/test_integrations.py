"""The LangChain and LlamaIndex adapters, with the real framework packages, against the
loopback test server (its dense vector is ``[len(text), position in batch, 1, 2]``)."""

from __future__ import annotations

import pytest

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def test_langchain_embeddings(server):
    pytest.importorskip("langchain_core")
    from langchain_core.embeddings import Embeddings

    from sdk.integrations.langchain import SIEEmbeddings

    emb = SIEEmbeddings(MODEL, base_url=server.url, batch_size=2, gpu="l4", options={"profile": "default"})
    assert isinstance(emb, Embeddings)
    docs = emb.embed_documents(["a", "bb", "ccc"])
    assert docs == [[1.0, 0.0, 1.0, 2.0], [2.0, 1.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]]  # two batches: 2 + 1
    assert all(type(x) is float for x in docs[0])
    assert emb.embed_query("dddd") == [4.0, 0.0, 1.0, 2.0]
    calls = server.calls("/v1/encode/")
    assert [len(c.body["items"]) for c in calls] == [2, 1, 1]
    assert [c.body["params"]["options"]["is_query"] for c in calls] == [False, False, True]
    assert calls[0].body["params"]["options"]["profile"] == "default"
    assert calls[0].headers["X-SIE-MACHINE-PROFILE"] == "l4"
    emb.close()


async def test_langchain_async_embeddings(server):
    pytest.importorskip("langchain_core")
    from sdk.integrations.langchain import SIEEmbeddings

    emb = SIEEmbeddings(MODEL, base_url=server.url)
    assert await emb.aembed_documents(["a", "bb"]) == [[1.0, 0.0, 1.0, 2.0], [2.0, 1.0, 1.0, 2.0]]
    assert await emb.aembed_query("ccc") == [3.0, 0.0, 1.0, 2.0]
    await emb.aclose()


def test_llamaindex_embedding(server):
    pytest.importorskip("llama_index.core")
    from llama_index.core.embeddings import BaseEmbedding

    from sdk.integrations.llamaindex import SIEEmbedding

    embed = SIEEmbedding(MODEL, base_url=server.url, embed_batch_size=2, instruction="find")
    assert isinstance(embed, BaseEmbedding)
    assert embed.model_name == MODEL
    assert embed.get_query_embedding("abc") == [3.0, 0.0, 1.0, 2.0]
    assert embed.get_text_embedding_batch(["a", "bb", "ccc"]) == [
        [1.0, 0.0, 1.0, 2.0],
        [2.0, 1.0, 1.0, 2.0],
        [3.0, 0.0, 1.0, 2.0],
    ]
    calls = server.calls("/v1/encode/")
    assert [c.body["params"]["options"]["is_query"] for c in calls] == [True, False, False]
    assert all(c.body["params"]["instruction"] == "find" for c in calls)


async def test_llamaindex_async_embedding(server):
    pytest.importorskip("llama_index.core")
    from sdk.integrations.llamaindex import SIEEmbedding

    embed = SIEEmbedding(MODEL, base_url=server.url)
    assert await embed.aget_query_embedding("ab") == [2.0, 0.0, 1.0, 2.0]
    assert await embed.aget_text_embedding_batch(["a", "bb"]) == [[1.0, 0.0, 1.0, 2.0], [2.0, 1.0, 1.0, 2.0]]
    await embed.aclose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
def test_framework_classes_fail_fast_when_nothing_listens(framework):
    """Issue 36: the adapters inherit the client's quick failure on a refused connection."""
    import socket

    from sdk import SIEConnectionError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    if framework == "langchain":
        pytest.importorskip("langchain_core")
        from sdk.integrations.langchain import SIEEmbeddings

        embed = SIEEmbeddings(MODEL, base_url=url).embed_query
    else:
        pytest.importorskip("llama_index.core")
        from sdk.integrations.llamaindex import SIEEmbedding

        embed = SIEEmbedding(MODEL, base_url=url).get_query_embedding
    with pytest.raises(SIEConnectionError, match=f"cannot connect to {url}"):
        embed("hello")
