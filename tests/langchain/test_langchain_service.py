"""The wrapper with the index service's client as its pilot: a real ``contextpilot-server``
process shared by two "app processes" (two clients), on the sync and the async paths (the one
``ContextPilotClient`` meets the ``Planner`` protocol with both twins), and a service that is
down."""

from __future__ import annotations

import asyncio

from langchain_support import Bm25sRetriever, ListRetriever, RecordingPilot

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotRetriever,
    RAGInputs,
)


def entry(doc) -> dict:
    return doc.metadata[METADATA_KEY]


def test_two_app_processes_share_one_index_through_the_service(
    service_url, multihop_documents, multihop_questions
):
    base = Bm25sRetriever(documents=multihop_documents, k=5)
    first = ContextPilotRetriever(base_retriever=base, pilot=ContextPilotClient(service_url))
    recording = RecordingPilot(ContextPilotClient(service_url))
    second = ContextPilotRetriever(base_retriever=base, pilot=recording)
    question = multihop_questions[3]
    one = first.invoke(question)
    two = second.invoke(question)  # another "process" asks the same question
    plan = recording.plan_for(entry(two[0])["rid"])
    assert plan.matched_prefix_blocks == len(two)  # aligned to the first's prompt
    assert [d.page_content for d in two] == [d.page_content for d in one]
    assert entry(one[0])["rid"] != entry(two[0])["rid"]

    out = RAGInputs(retriever=second).batch(multihop_questions[10:16])
    assert sorted(o["context"].schedule_position for o in out) == list(range(6))
    value = CONTEXTPILOT_PROMPT.invoke(out[0])
    assert value.rid == out[0]["context"].rid


def test_async_paths_await_the_clients_async_twins(
    service_url, multihop_documents, multihop_questions
):
    # An async client must pass the planner check only with async twins that are awaited.
    base = Bm25sRetriever(documents=multihop_documents, k=5)
    client = ContextPilotClient(service_url)
    retriever = ContextPilotRetriever(base_retriever=base, pilot=client)
    question = multihop_questions[20]
    sync = retriever.invoke(question)

    async def run() -> tuple[list, list]:
        one = await retriever.ainvoke(question)
        batch = await retriever.abatch(multihop_questions[21:25])
        return one, batch

    one, batch = asyncio.run(run())
    assert [d.page_content for d in one] == [d.page_content for d in sync]  # aligned to it
    assert entry(one[0])["rid"].startswith("cp-") and entry(one[0])["rid"] != entry(sync[0])["rid"]
    assert sorted(entry(docs[0])["schedule_position"] for docs in batch) == list(range(4))
    recording = RecordingPilot(client)
    asyncio.run(ContextPilotRetriever(base_retriever=base, pilot=recording).ainvoke(question))
    assert [c["method"] for c in recording.calls] == ["aplan"]
    assert recording.plans[-1].matched_prefix_blocks == len(sync)


def test_conversations_through_the_service(service_url, topic_documents):
    recording = RecordingPilot(ContextPilotClient(service_url))
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"a": topic_documents[:3]}), pilot=recording
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
    assert all(entry(d)["status"] == "replaced" for d in docs)
    assert recording.plan_for(entry(docs[0])["rid"]).scope.turn == 2
    docs = asyncio.run(retriever.ainvoke("a", config=meta))
    assert all(entry(d)["status"] == "replaced" for d in docs)
    assert recording.plan_for(entry(docs[0])["rid"]).scope.turn == 3


def test_a_service_that_is_down_never_fails_the_chain(topic_documents, caplog, unreachable_url):
    client = ContextPilotClient(unreachable_url, timeout=0.5)
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=3), pilot=client
    )
    with caplog.at_level("WARNING"):
        docs = retriever.invoke("kv cache prefix")
        batch = retriever.batch(["bm25", "eviction"])
        adocs = asyncio.run(retriever.ainvoke("kv cache prefix"))
        abatch = asyncio.run(retriever.abatch(["bm25", "eviction"]))
    assert len(docs) == 3 and all(entry(d)["rid"] for d in docs)  # planned locally
    assert [len(b) for b in batch] == [3, 3]
    assert len(adocs) == 3 and [len(b) for b in abatch] == [3, 3]
    assert caplog.text  # the outage was logged
