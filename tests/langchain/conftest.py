"""Fixtures for the LangChain adapter tests (helpers in ``langchain_support``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from contextpilot_bench.workloads import load_workload, resolve_data_dir
from langchain_core.documents import Document
from langchain_support import TOPICS, ChatServerState, MiniLMEmbeddings, chat_app, minilm_embeddings


@pytest.fixture
def topic_documents() -> list[Document]:
    """Eight short documents, one per topic, with a source in their metadata."""
    return [
        Document(page_content=f"{title}: {text}", metadata={"source": title})
        for title, text in TOPICS.items()
    ]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    try:
        return resolve_data_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"real data not available: {exc}")


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
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(chat_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("test chat server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
