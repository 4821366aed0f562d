"""The wrapper over real dense retrievers (all-MiniLM-L6-v2) on the MultiHop-RAG sample: Qdrant
in memory through langchain-qdrant (documents without ids) and langchain-core's
InMemoryVectorStore (documents with ids). LangChain's FAISS store lives only in
langchain-community, which is not a dependency here; Qdrant and the in-memory store cover the
dense path.

The reuse check replays the same questions through the embedded prefix-cache model
(``bench.engine.EmbeddedEngine``) in retriever order and as ContextPilot plans them."""

from __future__ import annotations

import pytest
from contextpilot_bench.engine import EmbeddedEngine
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_qdrant import QdrantVectorStore
from langchain_support import RecordingPilot

from contextpilot_integrations import ApproxTokenCounter, PromptLayout, block_id
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import ContextPilotRetriever

pytestmark = pytest.mark.slow  # loads MiniLM and embeds 80 articles (~10-40 s on two cores)

CORPUS_SIZE = 80  # articles embedded (first-seen order, so they cover the first questions)
QUESTIONS = 40


@pytest.fixture(scope="module")
def corpus(multihop_documents) -> list[Document]:
    return multihop_documents[:CORPUS_SIZE]


@pytest.fixture(scope="module")
def qdrant_store(corpus, minilm) -> QdrantVectorStore:
    return QdrantVectorStore.from_documents(
        corpus, minilm, location=":memory:", collection_name="multihop"
    )


@pytest.fixture(scope="module")
def memory_store(corpus, qdrant_store, minilm) -> InMemoryVectorStore:
    store = InMemoryVectorStore(minilm)
    store.add_documents(corpus, ids=[f"article-{i}" for i in range(len(corpus))])
    return store


def test_qdrant_documents_without_ids_keep_their_metadata(qdrant_store, corpus):
    retriever = ContextPilotRetriever(
        base_retriever=qdrant_store.as_retriever(search_kwargs={"k": 4})
    )
    title = corpus[7].metadata["title"]
    docs = retriever.invoke(title)
    assert len(docs) == 4 and all(d.id is None for d in docs)
    # Meaning matters here: the article whose title is the query is found.
    assert title in [d.metadata["title"] for d in docs]
    for doc in docs:
        assert doc.metadata["_collection_name"] == "multihop" and doc.metadata["_id"]
        assert doc.metadata[METADATA_KEY]["block_id"] == block_id(doc.page_content)


def test_in_memory_store_ids_are_kept(memory_store, corpus):
    retriever = ContextPilotRetriever(
        base_retriever=memory_store.as_retriever(search_kwargs={"k": 3})
    )
    docs = retriever.invoke(corpus[3].metadata["title"])
    assert all(d.id and d.id.startswith("article-") for d in docs)
    assert corpus[3].page_content in [d.page_content for d in docs]


@pytest.mark.parametrize("store_name", ["qdrant_store", "memory_store"])
def test_dense_retrieval_reuse_gain_on_real_questions(
    request, store_name, multihop_questions, minilm
):
    store = request.getfixturevalue(store_name)
    minilm.embed_documents(multihop_questions[:QUESTIONS])  # one encode call for all queries
    base = store.as_retriever(search_kwargs={"k": 5})
    questions = multihop_questions[:QUESTIONS]
    layout = PromptLayout()

    baseline = EmbeddedEngine(None, counter=ApproxTokenCounter())
    for n, question in enumerate(questions):
        texts = [d.page_content for d in base.invoke(question)]
        baseline.serve(f"base-{n}", layout.render_segments(texts, question))

    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(base_retriever=base, pilot=pilot)
    planned = EmbeddedEngine(None, counter=ApproxTokenCounter())
    for question in questions:
        docs = retriever.invoke(question)
        plan = pilot.plans[-1]
        assert [d.page_content for d in docs] == [b.text for b in plan.blocks]
        planned.serve(plan.rid, plan.segments)

    def hit_ratio(engine: EmbeddedEngine) -> float:
        stats = engine.model.stats()
        return stats.cached_tokens / stats.prompt_tokens

    assert hit_ratio(planned) > hit_ratio(baseline) + 0.05
