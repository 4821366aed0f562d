"""The plan's request id reaches a real ChatOpenAI request body; batches go out in schedule order
within the concurrency limit and come back in input order."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI
from langchain_support import Bm25sRetriever, RecordingPilot

from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotPromptValue,
    ContextPilotRetriever,
    RAGInputs,
    format_documents,
    schedule_order,
    with_plan_fields,
)


def openai_model(url: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(base_url=url, api_key="test-key", model="test-model", max_retries=0, **kwargs)


def rag_chain(retriever, llm):
    return (
        {"context": retriever | format_documents, "question": RunnablePassthrough()}
        | CONTEXTPILOT_PROMPT
        | llm
        | StrOutputParser()
    )


def test_standard_chain_sends_the_plan_rid_to_the_engine(chat_server, topic_documents):
    url, server = chat_server
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=3), pilot=pilot
    )
    chain = rag_chain(retriever, with_plan_fields(openai_model(url)))
    answer = chain.invoke("prefix cache eviction")
    assert answer.startswith("answer")
    (body,) = server.bodies
    rid = pilot.plans[-1].rid
    assert body["rid"] == body["request_id"] == body["session_id"] == rid
    assert body["messages"] == pilot.plans[-1].messages

    asyncio.run(chain.ainvoke("bm25 ranking"))
    assert server.bodies[-1]["rid"] == pilot.plans[-1].rid
    chunks = list(chain.stream("tokenizer boundary"))
    assert "".join(chunks).startswith("answer") and server.bodies[-1]["stream"] is True
    assert server.bodies[-1]["session_id"] == pilot.plans[-1].rid


def test_extra_body_is_merged_with_the_models_own(chat_server, topic_documents):
    url, server = chat_server
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents))
    own = {"chat_template_kwargs": {"enable_thinking": False}, "rid": "overridden"}
    rag_chain(retriever, with_plan_fields(openai_model(url, extra_body=own))).invoke("cache")
    body = server.bodies[-1]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["rid"].startswith("cp-") and body["rid"] == body["session_id"]

    bound = openai_model(url).bind(extra_body={"top_k": 5}, temperature=0.0)
    rag_chain(retriever, with_plan_fields(bound, engine="sglang")).invoke("cache")
    body = server.bodies[-1]
    assert body["top_k"] == 5 and body["temperature"] == 0.0 and body["rid"].startswith("cp-")
    assert body["session_id"] == body["rid"] and "request_id" not in body  # SGLang's fields

    rag_chain(retriever, with_plan_fields(openai_model(url), engine="vllm")).invoke("cache")
    body = server.bodies[-1]
    assert body["request_id"] == body["session_id"] and "rid" not in body  # vLLM's fields

    rag_chain(retriever, with_plan_fields(openai_model(url), engine="hosted")).invoke("cache")
    assert not {"rid", "request_id", "session_id"} & set(server.bodies[-1])


def test_inputs_without_a_plan_pass_through(chat_server):
    url, server = chat_server
    llm = with_plan_fields(openai_model(url))
    assert llm.invoke("hello").content.startswith("answer")
    assert "rid" not in server.bodies[-1]
    with pytest.raises(TypeError, match="llm must be a LangChain Runnable"):
        with_plan_fields(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        with_plan_fields(openai_model(url), max_concurrency=0)
    with pytest.raises(ValueError, match="engine"):
        with_plan_fields(openai_model(url), engine="bogus")  # type: ignore[arg-type]


def test_batch_goes_out_in_schedule_order_and_comes_back_in_input_order(
    chat_server, multihop_documents, multihop_questions
):
    url, server = chat_server
    questions = multihop_questions[:16]
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=multihop_documents, k=5), pilot=pilot
    )
    chain = (
        RAGInputs(retriever=retriever) | CONTEXTPILOT_PROMPT | with_plan_fields(openai_model(url))
    )
    answers = chain.batch(questions, config={"max_concurrency": 1})
    (batch,) = pilot.batches  # one joint plan for the whole batch
    sent = [body["rid"] for body in server.bodies]
    assert sent == [plan.rid for plan in batch.scheduled()]
    assert batch.schedule != tuple(range(len(questions)))  # the schedule did reorder
    # Answers in input order: the server numbers its answers in arrival order.
    arrival = {rid: n for n, rid in enumerate(sent, start=1)}
    assert [a.content for a in answers] == [f"answer {arrival[p.rid]}" for p in batch.plans]
    for plan, body in zip(batch.scheduled(), server.bodies):
        assert body["messages"] == plan.messages


def test_abatch_goes_out_in_schedule_order(chat_server, multihop_documents, multihop_questions):
    url, server = chat_server
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=multihop_documents, k=5), pilot=pilot
    )
    chain = (
        RAGInputs(retriever=retriever) | CONTEXTPILOT_PROMPT | with_plan_fields(openai_model(url))
    )
    answers = asyncio.run(chain.abatch(multihop_questions[:12], config={"max_concurrency": 1}))
    (batch,) = pilot.batches
    assert [b["rid"] for b in server.bodies] == [p.rid for p in batch.scheduled()]
    assert len(answers) == 12


@pytest.mark.parametrize("limit", [1, 3])
def test_concurrency_limit_is_respected(chat_server, topic_documents, limit):
    url, server = chat_server
    server.delay_s = 0.05
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents))
    llm = with_plan_fields(openai_model(url), max_concurrency=limit)
    chain = RAGInputs(retriever=retriever) | CONTEXTPILOT_PROMPT | llm
    questions = [f"cache question {i}" for i in range(8)]
    chain.batch(questions)
    assert server.max_in_flight <= limit
    server.max_in_flight = 0
    asyncio.run(chain.abatch(questions))
    assert server.max_in_flight <= limit
    assert limit == 1 or server.max_in_flight > 1


def test_batch_failures_and_schedule_order_helper():
    values = [
        ContextPilotPromptValue(messages=[], rid="a", schedule_position=2),
        ContextPilotPromptValue(messages=[], rid="b", schedule_position=0),
        ContextPilotPromptValue(messages=[], rid=None),
        ContextPilotPromptValue(messages=[], rid="c", schedule_position=1),
    ]
    assert schedule_order(values) == [1, 3, 0, 2]

    seen: list[str | None] = []

    def model(value, **kwargs):
        seen.append(value.rid)
        if value.rid == "c":
            raise RuntimeError("engine overloaded")
        return AIMessage(content=str(kwargs.get("extra_body", {}).get("rid")))

    llm = with_plan_fields(RunnableLambda(model))
    out = llm.batch(values, config={"max_concurrency": 1}, return_exceptions=True)
    assert seen == ["b", "c", "a", None]
    assert [getattr(o, "content", None) for o in out] == ["a", "b", "None", None]
    assert isinstance(out[3], RuntimeError)
    with pytest.raises(RuntimeError, match="overloaded"):
        llm.batch(values)
    with pytest.raises(RuntimeError, match="overloaded"):
        asyncio.run(llm.abatch(values))
    out = asyncio.run(llm.abatch(values, return_exceptions=True))
    assert isinstance(out[3], RuntimeError) and out[0].content == "a"


def test_fake_chat_model_in_the_chain_is_untouched_by_the_extra_body(topic_documents):
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents))
    llm = with_plan_fields(GenericFakeChatModel(messages=iter(["one", "two"])))
    chain = rag_chain(retriever, llm)
    assert chain.invoke("cache") == "one"
    docs = retriever.invoke("cache")
    assert docs[0].metadata[METADATA_KEY]["rid"].startswith("cp-")


def test_extra_body_is_found_through_wrappers(chat_server, topic_documents):
    url, server = chat_server
    retriever = ContextPilotRetriever(base_retriever=Bm25sRetriever(documents=topic_documents))
    model = openai_model(url, extra_body={"top_k": 3})
    for wrapped in (
        model.with_retry(stop_after_attempt=2),
        model.with_config(tags=["x"]),
        model.with_fallbacks([openai_model(url)]),
        model.bind(temperature=0.5).with_retry(stop_after_attempt=1),
    ):
        rag_chain(retriever, with_plan_fields(wrapped)).invoke("cache")
        body = server.bodies[-1]
        assert body["top_k"] == 3 and body["rid"].startswith("cp-"), type(wrapped).__name__


def test_a_prompt_that_is_not_contextpilots_is_warned_about_once(chat_server, caplog):
    url, server = chat_server
    llm = with_plan_fields(openai_model(url))
    with caplog.at_level("WARNING"):
        llm.invoke("hello")
        llm.invoke("again")
    assert caplog.text.count("no plan field is sent") == 1
