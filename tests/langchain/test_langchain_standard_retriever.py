"""langchain-tests' standard retriever tests, for the wrapper around three real retrievers.

No conversation id is given, so nothing is de-duplicated across calls and every call returns as
many documents as the base retriever (the corpora hold no repeated text).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_qdrant import QdrantVectorStore
from langchain_support import TOPICS, Bm25sRetriever, minilm_embeddings
from langchain_tests.integration_tests import RetrieversIntegrationTests

from contextpilot_integrations.langchain import ContextPilotRetriever


def _documents() -> list[Document]:
    return [
        Document(page_content=f"{t}: {text}", metadata={"source": t}) for t, text in TOPICS.items()
    ]


# The suite's async test lacks pytest-asyncio's marker (strict mode here) and the suite forbids
# overriding its tests: mark the suite's own function (the same object stays in place).
pytest.mark.asyncio(RetrieversIntegrationTests.test_ainvoke_returns_documents)


class _Standard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[ContextPilotRetriever]:
        return ContextPilotRetriever


class TestOverInMemoryVectorStore(_Standard):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        store = InMemoryVectorStore.from_documents(
            _documents(), DeterministicFakeEmbedding(size=32)
        )
        return {"base_retriever": store.as_retriever(search_kwargs={"k": 4})}

    @property
    def retriever_query_example(self) -> str:
        return "how does prefix caching reuse the KV cache?"


class TestOverBm25(_Standard):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"base_retriever": Bm25sRetriever(documents=_documents(), k=4)}

    @property
    def retriever_query_example(self) -> str:
        return "BM25 term frequency ranking"


@pytest.mark.slow  # loads MiniLM
class TestOverQdrantWithMiniLM(_Standard):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        store = QdrantVectorStore.from_documents(
            _documents(), minilm_embeddings(), location=":memory:", collection_name="standard"
        )
        return {"base_retriever": store.as_retriever(search_kwargs={"k": 4})}

    @property
    def retriever_query_example(self) -> str:
        return "which cache entries does the engine evict?"
