"""The wrapper with the index service's client as its pilot: a real ``contextpilot-server``
process shared by two "app processes" (two clients), and a service that is down."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from langchain_support import Bm25sRetriever, ListRetriever

from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    METADATA_KEY,
    ContextPilotRetriever,
    RAGInputs,
)
from contextpilot_integrations.service.client import ContextPilotClient


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def service_url() -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "contextpilot_integrations.service.server", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the service exited"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def entry(doc) -> dict:
    return doc.metadata[METADATA_KEY]


def test_two_app_processes_share_one_index_through_the_service(
    service_url, multihop_documents, multihop_questions
):
    base = Bm25sRetriever(documents=multihop_documents, k=5)
    first = ContextPilotRetriever(base_retriever=base, pilot=ContextPilotClient(service_url))
    second = ContextPilotRetriever(base_retriever=base, pilot=ContextPilotClient(service_url))
    question = multihop_questions[3]
    one = first.invoke(question)
    two = second.invoke(question)  # another "process" asks the same question
    assert entry(two[0])["matched_prefix_blocks"] == len(two)  # aligned to the first's prompt
    assert [d.page_content for d in two] == [d.page_content for d in one]
    assert entry(one[0])["rid"] != entry(two[0])["rid"]

    out = RAGInputs(retriever=second).batch(multihop_questions[10:16])
    assert sorted(o["context"].schedule_position for o in out) == list(range(6))
    value = CONTEXTPILOT_PROMPT.invoke(out[0])
    assert value.rid == out[0]["context"].rid


def test_conversations_through_the_service(service_url, topic_documents):
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"a": topic_documents[:3]}),
        pilot=ContextPilotClient(service_url),
    )
    meta = {
        "metadata": {
            "contextpilot_conversation_id": "svc",
            "contextpilot_visible_turns": "all",
            "contextpilot_tenant": "t",
        }
    }
    retriever.invoke("a", config=meta)
    docs = retriever.invoke("a", config=meta)
    assert all(entry(d)["replaced"] for d in docs) and entry(docs[0])["turn"] == 2


def test_a_service_that_is_down_never_fails_the_chain(topic_documents, caplog):
    client = ContextPilotClient(f"http://127.0.0.1:{_free_port()}", timeout=0.5)
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=3), pilot=client
    )
    with caplog.at_level("WARNING"):
        docs = retriever.invoke("kv cache prefix")
        batch = retriever.batch(["bm25", "eviction"])
    assert len(docs) == 3 and all(entry(d)["rid"] for d in docs)  # planned locally
    assert [len(b) for b in batch] == [3, 3]
    assert caplog.text  # the outage was logged
