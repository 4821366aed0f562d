"""Fixtures for the LangChain adapter tests (helpers in ``langchain_support``; the real data
directory, ``data_dir``, comes from ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from contextpilot_bench.workloads import load_workload
from langchain_core.documents import Document
from langchain_support import TOPICS, ChatServerState, MiniLMEmbeddings, chat_app, minilm_embeddings
from support.asgi_server import serve_in_thread


@pytest.fixture
def topic_documents() -> list[Document]:
    """Eight short documents, one per topic, with a source in their metadata."""
    return [
        Document(page_content=f"{title}: {text}", metadata={"source": title})
        for title, text in TOPICS.items()
    ]


@pytest.fixture(scope="session")
def multihop_documents(data_dir: Path) -> list[Document]:
    """The MultiHop-RAG sample's corpus (326 articles) as LangChain documents, no ids."""
    workload = load_workload("multihop-rag", data_dir)
    return [Document(page_content=d.text, metadata={"title": d.id}) for d in workload.corpus]


@pytest.fixture(scope="session")
def multihop_questions(data_dir: Path) -> list[str]:
    workload = load_workload("multihop-rag", data_dir)
    return [r.query for r in workload.requests]


@pytest.fixture(scope="session")
def minilm() -> MiniLMEmbeddings:
    return minilm_embeddings()


@pytest.fixture
def chat_server() -> Iterator[tuple[str, ChatServerState]]:
    """A running OpenAI-compatible server on 127.0.0.1: ``(base url with /v1, its state)``."""
    state = ChatServerState()
    with serve_in_thread(chat_app(state)) as url:
        yield f"{url}/v1", state
