"""RAGInputs: the same dict as the usual ``{"context": ..., "question": ...}`` map, with batches
planned jointly through the retriever's batch."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.runnables import RunnableParallel, RunnablePassthrough
from langchain_support import Bm25sRetriever, ListRetriever, RecordingPilot, RunRecorder

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import (
    ContextPilotRetriever,
    RAGInputs,
    RenderedContext,
    format_documents,
)


def test_invoke_matches_the_usual_map(topic_documents):
    base = Bm25sRetriever(documents=topic_documents, k=3)
    usual = {
        "context": ContextPilotRetriever(base_retriever=base, pilot=ContextPilot())
        | format_documents,
        "question": RunnablePassthrough(),
    }
    ours = RAGInputs(retriever=ContextPilotRetriever(base_retriever=base, pilot=ContextPilot()))
    for question in ("kv cache prefix", "bm25 saturation", "eviction of requests"):
        a, b = RunnableParallel(usual).invoke(question), ours.invoke(question)
        assert set(b) == {"context", "question"} and b["question"] == question
        assert isinstance(b["context"], RenderedContext) and b["context"].rid
        assert str(a["context"]) == str(b["context"])
        assert asyncio.run(ours.ainvoke(question))["question"] == question


def test_batch_plans_jointly_and_keeps_input_order(multihop_documents, multihop_questions):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=multihop_documents, k=5), pilot=pilot
    )
    questions = multihop_questions[:10]
    out = RAGInputs(retriever=retriever).batch(questions)
    assert [o["question"] for o in out] == questions
    assert [c["method"] for c in pilot.calls] == ["plan_batch"]
    (batch,) = pilot.batches
    assert [o["context"].rid for o in out] == [p.rid for p in batch.plans]
    positions = [o["context"].schedule_position for o in out]
    assert positions == list(batch.schedule_positions)
    assert sorted(positions) == list(range(10))
    assert [batch.schedule.index(i) for i in range(10)] == positions
    out = asyncio.run(RAGInputs(retriever=retriever).abatch(questions))
    assert [c["method"] for c in pilot.calls] == ["plan_batch", "aplan_batch"]
    assert [o["question"] for o in out] == questions


def test_dict_inputs_pass_their_other_keys_through(topic_documents):
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents))
    inputs = RAGInputs(retriever=retriever)
    out = inputs.invoke({"question": "kv cache", "history": ["earlier"]})
    assert out["history"] == ["earlier"] and out["question"] == "kv cache"
    out = inputs.batch([{"question": "kv cache", "user": "u1"}, "bm25"])
    assert out[0]["user"] == "u1" and out[1]["question"] == "bm25"


def test_bad_inputs_and_failures(topic_documents):
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"known": topic_documents[:2]})
    )
    inputs = RAGInputs(retriever=retriever)
    with pytest.raises(TypeError, match="input must be a question str or a dict"):
        inputs.invoke({"query": "wrong key"})
    with pytest.raises(KeyError):
        inputs.invoke("unknown")
    out = inputs.batch(["known", 7, "unknown"], return_exceptions=True)
    assert out[0]["context"].rid
    assert isinstance(out[1], TypeError) and isinstance(out[2], KeyError)
    with pytest.raises(TypeError):
        inputs.batch(["known", 7])
    out = asyncio.run(inputs.abatch(["known", 7, "unknown"], return_exceptions=True))
    assert isinstance(out[1], TypeError) and isinstance(out[2], KeyError)
    assert inputs.batch([]) == [] and asyncio.run(inputs.abatch([])) == []


def test_runs_are_nested_under_the_inputs_run(topic_documents):
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents))
    recorder = RunRecorder()
    RAGInputs(retriever=retriever).batch(["kv cache", "bm25"], config={"callbacks": [recorder]})
    outer = {r[2] for r in recorder.runs if r[1] == "RAGInputs"}
    wrapper = [r for r in recorder.runs if r[1] == "ContextPilotRetriever"]
    formatter = [r for r in recorder.runs if r[1] == "format_documents"]
    assert len(outer) == 2 and len(wrapper) == 2 and len(formatter) == 2
    assert {r[3] for r in wrapper} == outer and {r[3] for r in formatter} == outer


def test_conversations_in_a_batch(topic_documents):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"a": topic_documents[:3], "b": topic_documents[:3]}),
        pilot=pilot,
    )
    inputs = RAGInputs(retriever=retriever)
    configs = [
        {"metadata": {"contextpilot_conversation_id": c, "contextpilot_visible_turns": "all"}}
        for c in ("x", "y")
    ]
    inputs.batch(["a", "b"], config=configs)
    docs = retriever.invoke("b", config=configs[0])
    assert all(d.metadata[METADATA_KEY]["status"] == "replaced" for d in docs)
    assert pilot.plans[-1].scope.turn == 2 and pilot.plans[-1].scope.conversation_id == "x"
