"""ContextPilotMiddleware in real ``create_agent`` loops: a scripted tool-calling chat model
(deterministic), a BM25 retriever as the agent's search tool, and ``ChatOpenAI`` against a
local OpenAI-compatible server.

What is checked on every model call is what the model received: repeated search results
become pointers, each pointer names an earlier call whose result stands in the same request
and holds every document the pointer stands for (read from the tool message's artifact, not
from the planner), later calls start with exactly the messages earlier calls were sent, and
the engine fields arrive as call keywords (or on the wire).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from agent_support import (
    SYSTEM,
    ScriptedChatModel,
    artifacts_of,
    assert_no_dangling,
    assert_prefix_stable,
    final,
    pointers_in,
    scripted_server,
    search_call,
    search_tool,
    thread,
    tool_call_reply,
)
from langchain.agents import create_agent
from langchain.agents.middleware import (
    ClearToolUsesEdit,
    ContextEditingMiddleware,
    ModelRequest,
    SummarizationMiddleware,
)
from langchain_anthropic import ChatAnthropic
from langchain_anthropic.middleware import AnthropicPromptCachingMiddleware
from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import PrivateAttr
from support.asgi_server import serve_in_thread

from contextpilot_integrations.core.messages import MessagePlanner
from contextpilot_integrations.langchain.agent_middleware import ContextPilotMiddleware
from contextpilot_integrations.llm_call.anthropic_breakpoints import AnthropicCachePolicy

# ---------------------------------------------------------------------------------- helpers


class ScriptedAnthropic(ChatAnthropic):
    """A real ChatAnthropic that builds its wire payload and answers from a script instead of
    calling the API (``_get_request_payload`` is what it would send)."""

    script: list[AIMessage]
    _payloads: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @property
    def payloads(self) -> list[dict[str, Any]]:
        return self._payloads

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        payload = self._get_request_payload(messages, stop=stop, **kwargs)
        self._payloads.append(payload)
        message = self.script[len(self._payloads) - 1].model_copy()
        return ChatResult(generations=[ChatGeneration(message=message)])


# ---------------------------------------------------------------------------------- pointers
def test_repeated_results_get_pointers_and_the_prefix_stays_byte_stable(
    topic_documents: list[Document], caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedChatModel(
        script=[
            search_call("kv cache prefix", "c1"),
            search_call("kv cache prefix", "c2"),
            final("The KV cache keeps attention keys and values."),
            search_call("kv cache prefix", "c3"),
            final("As before."),
        ]
    )
    middleware = ContextPilotMiddleware(tenant="acme")
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        system_prompt=SYSTEM,
        middleware=[middleware],
        checkpointer=InMemorySaver(),
    )
    with caplog.at_level(logging.INFO, logger="contextpilot_integrations.langchain"):
        first = agent.invoke({"messages": [HumanMessage("What is a KV cache?")]}, thread("t1"))
        state = agent.invoke({"messages": [HumanMessage("And again?")]}, thread("t1"))

    received = [messages for messages, _ in model.calls]
    assert len(received) == 5
    assert_prefix_stable(received)
    pointer = '[Same result as search({"query": "kv cache prefix"}) above.]'
    assert received[2][-1].content == pointer  # the second search, sent as a pointer
    assert received[4][-1].content == pointer  # the search of the second turn too
    assert received[2][-1].id == first["messages"][4].id  # the same message, new content
    assert received[2][-1].artifact == first["messages"][4].artifact
    artifacts = artifacts_of(state["messages"])
    assert [assert_no_dangling(m, artifacts) for m in received] == [0, 0, 1, 1, 2]
    # The agent's state keeps what the tools returned.
    tool_messages = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert len({m.content for m in tool_messages}) == 1
    assert "[Doc 1]" in tool_messages[0].content

    stats = middleware.stats()
    assert stats["calls"] == 5 and stats["new_pointers"] == 2
    assert stats["pointers"] == 1 + 1 + 2  # pointers in the messages of calls 3, 4 and 5
    assert stats["tokens_removed"] > 0
    overall = {k: v for k, v in stats.items() if k != "conversations"}
    assert stats["conversations"] == {"acme": {"t1": overall}}
    lines = [r.getMessage() for r in caplog.records if "conversation='t1'" in r.getMessage()]
    assert all("tenant='acme'" in line for line in lines)
    assert len(lines) == 5 and "new_pointers=1" in lines[2]


def test_a_second_thread_gets_nothing_from_the_first(topic_documents: list[Document]) -> None:
    model = ScriptedChatModel(
        script=[
            search_call("radix tree eviction", "a1"),
            final(),
            search_call("radix tree eviction", "b1"),
            final(),
        ]
    )
    middleware = ContextPilotMiddleware(tenant="acme")
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        system_prompt=SYSTEM,
        middleware=[middleware],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("How does eviction work?")]}, thread("one"))
    agent.invoke({"messages": [HumanMessage("How does eviction work?")]}, thread("two"))

    second = [messages for messages, _ in model.calls[2:]]
    assert all(not pointers_in(m) for m in second)
    assert isinstance(second[1][-1], ToolMessage) and "[Doc 1]" in second[1][-1].content
    conversations = middleware.stats()["conversations"]["acme"]
    assert conversations["one"]["replayed"] == conversations["two"]["replayed"] == 2
    assert conversations["two"]["pointers"] == 0


def test_without_a_thread_nothing_is_remembered(topic_documents: list[Document]) -> None:
    model = ScriptedChatModel(
        script=[search_call("bm25", "x1"), final(), search_call("bm25", "x2"), final()]
    )
    planner = MessagePlanner()
    middleware = ContextPilotMiddleware(tenant="acme", planner=planner)
    agent = create_agent(
        model, [search_tool(topic_documents)], system_prompt=SYSTEM, middleware=[middleware]
    )
    agent.invoke({"messages": [HumanMessage("What is BM25?")]})
    agent.invoke({"messages": [HumanMessage("What is BM25?")]})

    assert planner.conversations == 0
    stats = middleware.stats()
    assert stats["calls"] == 4 and stats["replayed"] == 0 and stats["conversations"] == {}


# ---------------------------------------------------------------------------------- engine fields
def test_engine_fields_arrive_in_the_model_call_keywords(topic_documents: list[Document]) -> None:
    model = ScriptedChatModel(
        script=[search_call("scheduling", "s1"), final()], extra_body={"top_k": 20}
    )
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        middleware=[ContextPilotMiddleware(tenant="acme", cache_salt="salt-acme")],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("Why schedule?")]}, thread("t"))

    bodies = [kwargs["extra_body"] for _, kwargs in model.calls]
    for body in bodies:
        assert body["rid"] == body["request_id"] == body["session_id"]
        assert body["rid"].startswith("cp-")
        assert body["cache_salt"] == "salt-acme"
        assert body["top_k"] == 20  # the model's own extra_body is kept
    assert bodies[0]["rid"] != bodies[1]["rid"]


def test_openai_engine_sends_one_prompt_cache_key_per_conversation(
    topic_documents: list[Document],
) -> None:
    script = [search_call("embeddings", "e1"), final()]
    keys: dict[tuple[str, str], set[str]] = {}
    for tenant in ("acme", "globex"):
        for name in ("t1", "t2"):
            model = ScriptedChatModel(script=script)
            middleware = ContextPilotMiddleware(
                tenant=tenant, engine="openai", prompt_cache_retention="24h"
            )
            agent = create_agent(
                model, [search_tool(topic_documents)], middleware=[middleware],
                checkpointer=InMemorySaver(),
            )  # fmt: skip
            agent.invoke({"messages": [HumanMessage("Embeddings?")]}, thread(name))
            assert all("extra_body" not in kwargs for _, kwargs in model.calls)
            assert {kwargs["prompt_cache_retention"] for _, kwargs in model.calls} == {"24h"}
            keys[tenant, name] = {kwargs["prompt_cache_key"] for _, kwargs in model.calls}
    assert all(len(k) == 1 for k in keys.values())
    assert len(set.union(*keys.values())) == 4

    model = ScriptedChatModel(script=script)
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        middleware=[ContextPilotMiddleware(engine="none")],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("Embeddings?")]}, thread("t1"))
    assert all(
        "extra_body" not in kwargs and "prompt_cache_key" not in kwargs for _, kwargs in model.calls
    )


def test_anthropic_breakpoint_after_prompt_caching_middleware(
    topic_documents: list[Document],
) -> None:
    """AnthropicPromptCachingMiddleware outer: its system, tool and tail markers stand, the
    library adds one on the last replayed message, never more than four in all."""
    model = ScriptedAnthropic(
        model="claude-sonnet-4-5",
        api_key="test-key",
        script=[
            search_call("kv cache prefix", "toolu_1"),
            search_call("kv cache prefix", "toolu_2"),
            final(),
        ],
    )
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        system_prompt=SYSTEM,
        middleware=[
            AnthropicPromptCachingMiddleware(),
            ContextPilotMiddleware(
                engine="anthropic", cache_policy=AnthropicCachePolicy(min_tokens=0)
            ),
        ],
        checkpointer=InMemorySaver(),
    )
    state = agent.invoke({"messages": [HumanMessage("What is a KV cache?")]}, thread("t"))

    def markers(payload: dict[str, Any]) -> list[str]:
        found = ["call"] if payload.get("cache_control") else []
        found += ["system" for b in payload["system"] if "cache_control" in b]
        found += ["tool" for t in payload.get("tools", ()) if "cache_control" in t]
        for i, message in enumerate(payload["messages"]):
            content = message["content"]
            blocks = content if isinstance(content, list) else []
            found += [f"message {i}" for b in blocks if "cache_control" in b]
        return found

    payloads = model.payloads
    assert [markers(p) for p in payloads] == [
        ["call", "system", "tool"],  # nothing replayed yet
        ["call", "system", "tool", "message 0"],  # the question, sent before
        ["call", "system", "tool", "message 2"],  # the first search result
    ]
    results = [
        b
        for message in payloads[2]["messages"]
        if isinstance(message["content"], list)
        for b in message["content"]
        if b.get("type") == "tool_result"
    ]
    full = next(m for m in state["messages"] if isinstance(m, ToolMessage)).content
    assert [r["content"] for r in results] == [
        full,  # unchanged under its marker
        '[Same result as search({"query": "kv cache prefix"}) above.]',
    ]


@pytest.mark.parametrize("app_markers", [3, 4])
def test_anthropic_breakpoints_stay_within_four(
    topic_documents: list[Document], app_markers: int
) -> None:
    """The app's markers (system blocks, a tool, a message block) count: with three the
    library adds its one on the last replayed message, with four none."""
    model = ScriptedChatModel(script=[search_call("bm25", "b1"), final()])
    mark = {"type": "ephemeral"}
    tool = search_tool(topic_documents)
    tool = tool.model_copy(update={"extras": {"cache_control": mark}})
    system = SystemMessage(
        content=[
            {"type": "text", "text": "Part one.", "cache_control": mark},
            {"type": "text", "text": "Part two.", "cache_control": mark},
        ]
    )
    question: list[str | dict[str, Any]] = [{"type": "text", "text": "BM25?"}]
    if app_markers == 4:
        question = [{"type": "text", "text": "BM25?", "cache_control": mark}]
    agent = create_agent(
        model,
        [tool],
        system_prompt=system,
        middleware=[
            ContextPilotMiddleware(
                engine="anthropic", cache_policy=AnthropicCachePolicy(min_tokens=0)
            )
        ],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage(content=question)]}, thread("t"))

    sent = model.calls[1][0]
    assert isinstance(sent[1], HumanMessage) and isinstance(sent[1].content, list)
    assert sent[1].content[0]["text"] == "BM25?"
    in_messages = sum(
        "cache_control" in b for m in sent if isinstance(m.content, list) for b in m.content
    )
    assert in_messages + 1 == 4  # the tool's marker is the fourth
    assert isinstance(sent[-1], ToolMessage) and isinstance(sent[-1].content, str)


# ---------------------------------------------------------------------------------- pairings
def _editing_agent(
    topic_documents: list[Document], order: str
) -> tuple[ScriptedChatModel, ContextPilotMiddleware, Any]:
    model = ScriptedChatModel(
        script=[
            search_call("kv cache prefix", "c1"),
            search_call("kv cache prefix", "c2"),
            search_call("radix tree eviction", "c3"),
            search_call("bm25 ranking", "c4"),
            final(),
        ]
    )
    pilot = ContextPilotMiddleware(tenant="acme")
    # Clear all but the two newest tool results once the request holds three.
    editing = ContextEditingMiddleware(
        edits=[ClearToolUsesEdit(trigger=2, keep=2)],
        token_counter=lambda messages: sum(isinstance(m, ToolMessage) for m in messages),
    )
    middleware = [editing, pilot] if order == "editing outer" else [pilot, editing]
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        system_prompt=SYSTEM,
        middleware=middleware,
        checkpointer=InMemorySaver(),
    )
    return model, pilot, agent


def test_context_editing_first_leaves_no_dangling_pointer(
    topic_documents: list[Document],
) -> None:
    model, pilot, agent = _editing_agent(topic_documents, "editing outer")
    state = agent.invoke({"messages": [HumanMessage("KV cache?")]}, thread("t"))

    received = [messages for messages, _ in model.calls]
    artifacts = artifacts_of(state["messages"])
    assert [assert_no_dangling(m, artifacts) for m in received] == [0, 0, 1, 0, 2]
    # Call 4: the first result is cleared, so the second goes out in full again.
    results = [m.content for m in received[3] if isinstance(m, ToolMessage)]
    assert results[0] == "[cleared]" and "[Doc 1]" in results[1]
    # Call 5: two documents of the fourth call's result are named by label there.
    assert pilot.stats()["new_pointers"] == 3


@pytest.mark.parametrize("run", ["sync", "async"])
def test_context_editing_after_the_library_turns_planning_off(
    topic_documents: list[Document], run: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Listed after, ContextEditingMiddleware would clear a result that a checked pointer
    names (call 4: the first result cleared, the second a pointer to it). The call is stopped
    before it is sent, and it and every later call go out as the agent gave them."""
    model, pilot, agent = _editing_agent(topic_documents, "editing inner")
    given = {"messages": [HumanMessage("KV cache?")]}
    with caplog.at_level(logging.WARNING, "contextpilot_integrations.langchain"):
        if run == "sync":
            state = agent.invoke(given, thread("t"))
        else:
            state = asyncio.run(agent.ainvoke(given, thread("t")))

    received = [messages for messages, _ in model.calls]
    assert len(received) == 5  # the stopped attempt never reached the model
    artifacts = artifacts_of(state["messages"])
    assert [assert_no_dangling(m, artifacts) for m in received] == [0, 0, 1, 0, 0]
    results = [m.content for m in received[3] if isinstance(m, ToolMessage)]
    assert results[0] == "[cleared]" and "[Doc 1]" in results[1]
    assert not any(pointers_in(m) for m in received[3:])
    assert not pilot.planning
    # Counted: the three calls sent as planned, never the stopped one's pointer.
    assert (pilot.stats()["calls"], pilot.stats()["new_pointers"]) == (3, 1)
    assert "list it before ContextPilotMiddleware" in caplog.text
    # The stop is no callback error: LangChain's callback manager logs nothing of it.
    assert "_SentCheck" not in caplog.text and "callback" not in caplog.text
    # The engine's fields still go with every call.
    assert all("rid" in keywords["extra_body"] for _, keywords in model.calls)


def test_summarization_leaves_no_dangling_pointer(topic_documents: list[Document]) -> None:
    twice = AIMessage(
        content="",
        tool_calls=[
            {"name": "search", "args": {"query": "kv cache prefix"}, "id": i, "type": "tool_call"}
            for i in ("c3", "c4")
        ],
    )
    model = ScriptedChatModel(
        script=[
            search_call("kv cache prefix", "c1"),
            search_call("kv cache prefix", "c2"),
            twice,
            final(),
        ]
    )
    pilot = ContextPilotMiddleware(tenant="acme")
    summarization = SummarizationMiddleware(
        model,
        trigger=("messages", 5),
        keep=("messages", 2),
        summarizer=lambda messages: f"Summary of {len(messages)} messages.",
    )
    agent = create_agent(
        model,
        [search_tool(topic_documents)],
        system_prompt=SYSTEM,
        middleware=[summarization, pilot],
        checkpointer=InMemorySaver(),
    )
    state = agent.invoke({"messages": [HumanMessage("KV cache?")]}, thread("t"))

    received = [messages for messages, _ in model.calls]
    artifacts = artifacts_of(state["messages"])
    # Call 3: the question, the first call and its result are summarised; the second result,
    # a pointer to the first in an unsummarised run, goes out in full. Call 4: summarised
    # again; of the two results of one call, the second points at the first.
    assert [assert_no_dangling(m, artifacts) for m in received] == [0, 0, 0, 1]
    for messages in received[2:]:
        assert isinstance(messages[1], HumanMessage) and "Summary of" in messages[1].text
    assert "[Doc 1]" in received[2][-1].content
    assert [m.tool_call_id for m in received[3] if isinstance(m, ToolMessage)] == ["c3", "c4"]
    assert pilot.stats()["new_pointers"] == 1


# ---------------------------------------------------------------------------------- async
def test_async_agent_plans_the_same_messages(topic_documents: list[Document]) -> None:
    def script() -> list[AIMessage]:
        return [
            search_call("kv cache prefix", "c1"),
            search_call("kv cache prefix", "c2"),
            final(),
        ]

    def build(model: ScriptedChatModel) -> Any:
        return create_agent(
            model,
            [search_tool(topic_documents)],
            system_prompt=SYSTEM,
            middleware=[ContextPilotMiddleware(tenant="acme")],
            checkpointer=InMemorySaver(),
        )

    sync_model, async_model = ScriptedChatModel(script=script()), ScriptedChatModel(script=script())
    question = {"messages": [HumanMessage("What is a KV cache?", id="q1")]}
    build(sync_model).invoke(question, thread("t"))
    asyncio.run(build(async_model).ainvoke(question, thread("t")))

    def texts(model: ScriptedChatModel) -> list[list[Any]]:
        return [[m.content for m in messages] for messages, _ in model.calls]

    assert texts(async_model) == texts(sync_model)
    assert_prefix_stable([messages for messages, _ in async_model.calls])
    assert pointers_in(async_model.calls[2][0])
    assert all("rid" in kwargs["extra_body"] for _, kwargs in async_model.calls)


# ---------------------------------------------------------------------------------- the wire


def test_chat_openai_sends_the_fields_and_the_pointers(topic_documents: list[Document]) -> None:
    replies = [
        tool_call_reply("kv cache prefix", "call_1"),
        tool_call_reply("kv cache prefix", "call_2"),
        {"role": "assistant", "content": "The KV cache keeps keys and values."},
    ]
    bodies: list[dict[str, Any]] = []
    with serve_in_thread(scripted_server(replies, bodies)) as url:
        model = ChatOpenAI(
            base_url=f"{url}/v1",
            api_key="test-key",  # type: ignore[arg-type]
            model="test-model",
            max_retries=0,
            extra_body={"top_k": 20},
        )
        agent = create_agent(
            model,
            [search_tool(topic_documents)],
            system_prompt=SYSTEM,
            middleware=[ContextPilotMiddleware(tenant="acme", cache_salt="salt-acme")],
            checkpointer=InMemorySaver(),
        )
        state = agent.invoke({"messages": [HumanMessage("What is a KV cache?")]}, thread("t"))

    assert state["messages"][-1].content == "The KV cache keeps keys and values."
    assert len(bodies) == 3
    for body in bodies:
        assert body["rid"] == body["request_id"] == body["session_id"]
        assert body["cache_salt"] == "salt-acme" and body["top_k"] == 20
    assert len({body["rid"] for body in bodies}) == 3
    for before, after in zip(bodies, bodies[1:], strict=False):
        assert after["messages"][: len(before["messages"])] == before["messages"]
    tool_messages = [m for m in bodies[2]["messages"] if m["role"] == "tool"]
    assert "[Doc 1]" in tool_messages[0]["content"]
    assert tool_messages[1] == {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": '[Same result as search({"query": "kv cache prefix"}) above.]',
    }


# ---------------------------------------------------------------------------------- one request
def _request(messages: list[BaseMessage]) -> ModelRequest:
    return ModelRequest(model=ScriptedChatModel(script=[]), messages=messages)


def test_content_keeps_its_form_and_other_messages_are_the_same_objects() -> None:
    text = "\n\n".join(f"[{i}] Document {i}: " + "words " * 20 for i in (1, 2))
    messages: list[BaseMessage] = [
        HumanMessage("Search twice."),
        search_call("q", "c1"),
        ToolMessage(content=[{"type": "text", "text": text}], tool_call_id="c1", name="search"),
        search_call("q", "c2"),
        ToolMessage(content=[text], tool_call_id="c2", name="search", artifact={"k": 1}),
    ]
    sent = ContextPilotMiddleware(engine="none").prepare(_request(messages)).messages

    assert all(a is b for a, b in zip(sent[:4], messages[:4], strict=True))
    pointer = '[Same result as search({"query": "q"}) above.]'
    assert sent[4].content == [pointer]  # a list of one str stays one
    assert sent[4].artifact == {"k": 1} and sent[4].name == "search"
    assert messages[4].content == [text]  # the caller's message is untouched


def test_a_request_the_planner_refuses_is_sent_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    messages: list[BaseMessage] = [
        HumanMessage("Hi."),
        search_call("q", "c1"),
        ToolMessage(content="result", tool_call_id=""),  # no call id: not a tool result
    ]
    with caplog.at_level(logging.WARNING, logger="contextpilot_integrations.langchain"):
        request = ContextPilotMiddleware().prepare(_request(messages))
    assert request.messages == messages and "rid" in request.model_settings["extra_body"]
    assert "sent unplanned" in caplog.text and "tool_call_id" in caplog.text


def test_tool_call_arguments_json_cannot_encode_are_sent_unplanned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    messages: list[BaseMessage] = [
        HumanMessage("Hi."),
        AIMessage("", tool_calls=[{"name": "search", "args": {"q": {1, 2}}, "id": "a"}]),
        ToolMessage(content="result", tool_call_id="a"),
    ]
    with caplog.at_level(logging.WARNING, logger="contextpilot_integrations.langchain"):
        request = ContextPilotMiddleware().prepare(_request(messages))
    assert request.messages == messages and "rid" in request.model_settings["extra_body"]
    assert "sent unplanned" in caplog.text


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"engine": "sglang"}, "engine must be one of"),
        ({"tenant": 3}, "tenant must be a str"),
        ({"cache_salt": ""}, "cache_salt must be a non-empty str"),
        ({"prompt_cache_retention": "1h"}, "prompt_cache_retention must be"),
        ({"planner": object()}, "planner must be a MessagePlanner"),
        ({"cache_policy": {}}, "cache_policy must be an AnthropicCachePolicy"),
        ({"max_conversations": 0}, "max_conversations must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ContextPilotMiddleware(**arguments)
