"""with_plan_fields as a tool-calling model: ``bind_tools``, ``bind`` and
``with_structured_output`` return the model's bound runnable wrapped the same way, so a plan's
prompt value still sends its fields (sync, async, stream, batch in schedule order), and the
wrapped model runs a real ``create_agent`` loop (a scripted tool-calling model, and
``ChatOpenAI`` against a local OpenAI-compatible server on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from agent_support import (
    SYSTEM,
    ScriptedChatModel,
    final,
    scripted_server,
    search_call,
    search_tool,
    thread,
    tool_call_reply,
)
from langchain.agents import create_agent
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langchain_support import Bm25sRetriever, RecordingPilot
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import BaseModel
from support.asgi_server import serve_in_thread

from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotPromptValue,
    ContextPilotRetriever,
    RAGInputs,
    with_plan_fields,
)
from contextpilot_integrations.langchain.agent_middleware import ContextPilotMiddleware
from contextpilot_integrations.langchain.plan_fields import PlanFieldsChatModel


@tool
def lookup(term: str) -> str:
    """Look a term up in the glossary."""
    return f"{term}: a term"


class Answer(BaseModel):
    """The answer and the documents it cites."""

    text: str
    cited: list[str]


def answer_call() -> AIMessage:
    args = {"text": "KV reuse.", "cited": ["[Doc 1]"]}
    return AIMessage(
        content="", tool_calls=[{"name": "Answer", "args": args, "id": "a1", "type": "tool_call"}]
    )


def prompt(rid: str | None, position: int | None = None) -> ContextPilotPromptValue:
    return ContextPilotPromptValue(
        messages=[HumanMessage(f"question of {rid}")], rid=rid, schedule_position=position
    )


# ---------------------------------------------------------------------------------- bound runnables
def test_bind_tools_sends_the_plan_fields_sync_async_stream_and_batch() -> None:
    model = ScriptedChatModel(script=[final(f"answer {i}") for i in range(12)], extra_body={"k": 1})
    bound = with_plan_fields(model).bind_tools([lookup], tool_choice="auto")
    assert isinstance(bound, PlanFieldsChatModel)

    bound.invoke(prompt("cp-a"))
    asyncio.run(bound.ainvoke(prompt("cp-b")))
    list(bound.stream(prompt("cp-c")))

    async def astream() -> None:
        async for _ in bound.astream(prompt("cp-d")):
            pass

    asyncio.run(astream())
    for rid, (_, kwargs) in zip("abcd", model.calls, strict=True):
        assert kwargs["tools"][0]["function"]["name"] == "lookup"
        assert kwargs["tool_choice"] == "auto"
        assert kwargs["extra_body"] == {
            "k": 1,  # the model's own extra_body, kept
            "rid": f"cp-{rid}",
            "request_id": f"cp-{rid}",
            "session_id": f"cp-{rid}",
        }

    values = [prompt("cp-x", 2), prompt("cp-y", 0), prompt(None), prompt("cp-z", 1)]
    out = bound.batch(values, config={"max_concurrency": 1})
    sent = [kwargs.get("extra_body", {}).get("rid") for _, kwargs in model.calls[4:8]]
    assert sent == ["cp-y", "cp-z", "cp-x", None]  # schedule order, unplanned last
    assert [m.content for m in out] == ["answer 6", "answer 4", "answer 7", "answer 5"]
    asyncio.run(bound.abatch(values, config={"max_concurrency": 1}))
    sent = [kwargs.get("extra_body", {}).get("rid") for _, kwargs in model.calls[8:]]
    assert sent == ["cp-y", "cp-z", "cp-x", None]


def test_bind_keeps_the_models_own_extra_body_and_the_wrapper() -> None:
    model = ScriptedChatModel(script=[final(), final()], extra_body={"k": 1})
    bound = with_plan_fields(model, engine="vllm").bind(extra_body={"top_p": 0.5}, temperature=0.0)
    assert isinstance(bound, PlanFieldsChatModel) and bound.engine == "vllm"
    bound.invoke(prompt("cp-a"))
    bound.invoke([HumanMessage("no plan")])
    (_, planned), (_, unplanned) = model.calls
    assert planned["extra_body"] == {
        "k": 1,
        "top_p": 0.5,
        "request_id": "cp-a",
        "session_id": "cp-a",
    }
    assert planned["temperature"] == 0.0
    assert unplanned["extra_body"] == {"k": 1, "top_p": 0.5}


@pytest.mark.parametrize("include_raw", [False, True])
def test_with_structured_output_sends_the_plan_fields(include_raw: bool) -> None:
    model = ScriptedChatModel(script=[answer_call() for _ in range(3)])
    structured = with_plan_fields(model).with_structured_output(Answer, include_raw=include_raw)

    outputs = [
        structured.invoke(prompt("cp-a")),
        asyncio.run(structured.ainvoke(prompt("cp-b"))),
    ]
    for output in outputs:
        parsed = output["parsed"] if include_raw else output
        assert parsed == Answer(text="KV reuse.", cited=["[Doc 1]"])
    list(structured.stream(prompt("cp-c")))  # what a stream parses is LangChain's matter
    for rid, (_, kwargs) in zip("abc", model.calls, strict=True):
        assert kwargs["extra_body"]["rid"] == f"cp-{rid}"
        assert kwargs["tools"][0]["function"]["name"] == "Answer"


def test_a_runnable_without_bind_tools_is_named() -> None:
    wrapped = with_plan_fields(RunnableLambda(lambda value: value))
    with pytest.raises(AttributeError, match="wraps RunnableLambda, which has no bind_tools"):
        wrapped.bind_tools([lookup])
    with pytest.raises(AttributeError, match="which has no with_structured_output"):
        wrapped.with_structured_output(Answer)


# ---------------------------------------------------------------------------------- create_agent
def test_a_wrapped_model_runs_an_agent_loop_with_the_middlewares_fields(
    topic_documents: list[Document], caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedChatModel(
        script=[search_call("kv cache prefix", "c1"), search_call("radix tree", "c2"), final()],
        extra_body={"top_k": 20},
    )
    agent = create_agent(
        with_plan_fields(model),
        [search_tool(topic_documents)],
        system_prompt=SYSTEM,
        middleware=[ContextPilotMiddleware(tenant="acme", cache_salt="salt-acme")],
        checkpointer=InMemorySaver(),
    )
    with caplog.at_level(logging.WARNING, logger="contextpilot_integrations.langchain"):
        state = agent.invoke({"messages": [HumanMessage("What is a KV cache?")]}, thread("t"))

    assert state["messages"][-1].content == "Done."
    assert len([m for m in state["messages"] if isinstance(m, ToolMessage)]) == 2
    assert len(model.calls) == 3
    rids = set()
    for _, kwargs in model.calls:
        assert [t["function"]["name"] for t in kwargs["tools"]] == ["search"]
        body = kwargs["extra_body"]
        assert body["rid"] == body["request_id"] == body["session_id"]
        assert body["cache_salt"] == "salt-acme" and body["top_k"] == 20
        rids.add(body["rid"])
    assert len(rids) == 3
    # Messages, not a prompt value, reach the wrapper: one warning, not one per call.
    assert caplog.text.count("no plan field is sent") == 1


def test_a_wrapped_model_runs_an_agent_without_middleware(topic_documents: list[Document]) -> None:
    model = ScriptedChatModel(script=[search_call("bm25", "c1"), final("BM25 ranks terms.")])
    agent = create_agent(with_plan_fields(model), [search_tool(topic_documents)])
    state = agent.invoke({"messages": [HumanMessage("What is BM25?")]})
    assert state["messages"][-1].content == "BM25 ranks terms."
    assert all("extra_body" not in kwargs for _, kwargs in model.calls)


# ---------------------------------------------------------------------------------- the wire
def openai_model(url: str, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=url,
        api_key="test-key",  # type: ignore[arg-type]
        model="test-model",
        max_retries=0,
        **kwargs,
    )


def test_chat_openai_bind_tools_sends_the_plan_rid_on_the_wire(
    chat_server: tuple[str, Any], topic_documents: list[Document]
) -> None:
    url, server = chat_server
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=3), pilot=pilot
    )
    llm = with_plan_fields(openai_model(url, extra_body={"top_k": 5})).bind_tools([lookup])
    chain = RAGInputs(retriever=retriever) | CONTEXTPILOT_PROMPT | llm

    chain.invoke("prefix cache eviction")
    asyncio.run(chain.ainvoke("bm25 ranking"))
    list(chain.stream("tokenizer boundary"))
    assert len(server.bodies) == len(pilot.plans) == 3
    for body, plan in zip(server.bodies, pilot.plans, strict=True):
        assert body["rid"] == body["request_id"] == body["session_id"] == plan.rid
        assert body["top_k"] == 5
        assert [t["function"]["name"] for t in body["tools"]] == ["lookup"]
        assert body["messages"] == plan.messages
    assert server.bodies[-1]["stream"] is True


def test_chat_openai_agent_through_the_wrapper_sends_tools_and_fields(
    topic_documents: list[Document],
) -> None:
    replies = [
        tool_call_reply("kv cache prefix", "call_1"),
        {"role": "assistant", "content": "The KV cache keeps keys and values."},
    ]
    bodies: list[dict[str, Any]] = []
    with serve_in_thread(scripted_server(replies, bodies)) as url:
        agent = create_agent(
            with_plan_fields(openai_model(f"{url}/v1", extra_body={"top_k": 20})),
            [search_tool(topic_documents)],
            system_prompt=SYSTEM,
            middleware=[ContextPilotMiddleware(tenant="acme", cache_salt="salt-acme")],
            checkpointer=InMemorySaver(),
        )
        state = agent.invoke({"messages": [HumanMessage("What is a KV cache?")]}, thread("t"))

    assert state["messages"][-1].content == "The KV cache keeps keys and values."
    assert len(bodies) == 2
    for body in bodies:
        assert [t["function"]["name"] for t in body["tools"]] == ["search"]
        assert body["rid"] == body["request_id"] == body["session_id"]
        assert body["cache_salt"] == "salt-acme" and body["top_k"] == 20
    assert bodies[1]["messages"][: len(bodies[0]["messages"])] == bodies[0]["messages"]
    assert bodies[1]["messages"][-1]["role"] == "tool"
