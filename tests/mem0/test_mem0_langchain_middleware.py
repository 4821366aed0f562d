"""Mem0MemoryMiddleware in a real LangChain agent (create_agent) with a fake chat model: the
memory context goes in front of the user message that opens the turn, the system message stays
the agent's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from mem0 import Memory

from contextpilot_integrations.llm_call.engine_fields import REQUEST_ID_FIELDS
from contextpilot_integrations.mem0 import (
    MEMORY_LAYOUT,
    AsyncContextPilotMemory,
    ContextPilotMemory,
)
from contextpilot_integrations.mem0.langchain_middleware import (
    MEMORY_CHARS_KEY,
    Mem0MemoryMiddleware,
)
from contextpilot_integrations.mem0.layout import plain_memory_context

FACTS = [
    "Alice drinks green tea every morning.",
    "Alice lives in Montreal with her cat Miso.",
    "Alice runs the half marathon every September.",
    "Alice is vegetarian and cooks lentil curry.",
]
SYSTEM = "You are Alice's assistant."
SEARCH = {"threshold": 0.0}


class PromptRecorder(BaseCallbackHandler):
    """Keeps the messages and invocation parameters of every chat model call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[BaseMessage], dict[str, Any]]] = []

    def on_chat_model_start(
        self, serialized: dict[str, Any], messages: list[list[BaseMessage]], **kwargs: Any
    ) -> None:
        self.calls.append((messages[0], kwargs.get("invocation_params") or {}))


def _agent(middleware: Mem0MemoryMiddleware, answers: int = 4) -> Any:
    model = GenericFakeChatModel(messages=iter([AIMessage(f"answer {i}") for i in range(answers)]))
    return create_agent(model, system_prompt=SYSTEM, middleware=[middleware])


def _ask(agent: Any, question: str, recorder: PromptRecorder, **context: str) -> dict[str, Any]:
    return agent.invoke(
        {"messages": [{"role": "user", "content": question}]},
        context=context or None,
        config={"callbacks": [recorder]},
    )


def _store(memory: Any) -> None:
    for text in FACTS:
        memory.add(text, user_id="alice", infer=False)


def test_plain_memory_gets_mem0_order(mem0_memory: Memory) -> None:
    _store(mem0_memory)
    recorder = PromptRecorder()
    agent = _agent(Mem0MemoryMiddleware(mem0_memory, search_kwargs=SEARCH, engine="any"))
    state = _ask(agent, "What does Alice drink?", recorder, user_id="alice")
    expected = mem0_memory.search("What does Alice drink?", filters={"user_id": "alice"}, **SEARCH)
    ((messages, params),) = recorder.calls
    assert "extra_body" not in params  # a plain memory makes no plan: no rid to send
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage]
    context = plain_memory_context([r["memory"] for r in expected["results"]])
    assert messages[0].content == SYSTEM
    assert messages[1].content == f"{context}What does Alice drink?"
    # The state keeps the message the model saw (same id), marked with the context's length.
    asked = state["messages"][0]
    assert asked.content == messages[1].content and asked.id == messages[1].id
    assert asked.additional_kwargs[MEMORY_CHARS_KEY] == len(context)


def test_wrapping_the_memory_aligns_and_annotates(mem0_memory: Memory) -> None:
    _store(mem0_memory)
    memory = ContextPilotMemory(mem0_memory)  # the one line
    recorder = PromptRecorder()
    agent = _agent(Mem0MemoryMiddleware(memory, search_kwargs=SEARCH, engine="any"))
    _ask(agent, "What does Alice drink?", recorder, user_id="alice")
    _ask(agent, "Where does Alice live with her cat?", recorder, user_id="alice")
    (first, first_params), (second, second_params) = recorder.calls
    for messages in (first, second):
        assert [type(m) for m in messages] == [SystemMessage, HumanMessage]
        assert messages[0].content == SYSTEM
        assert messages[1].content.startswith(f"{MEMORY_LAYOUT.system_prompt}\n")
    contexts = [m[1].content[: m[1].additional_kwargs[MEMORY_CHARS_KEY]] for m in (first, second)]
    assert first[1].content == f"{contexts[0]}What does Alice drink?"
    # The first call shows Mem0's order (no annotation needed); the second starts with the
    # first call's system prompt and memories, in that order, and annotates Mem0's order.
    assert contexts[0].endswith("-----\n")
    assert contexts[1].startswith(contexts[0])
    assert "Most relevant memories first: [Memory" in contexts[1]
    raw = mem0_memory.search(
        "Where does Alice live with her cat?", filters={"user_id": "alice"}, **SEARCH
    )
    assert contexts[1] != plain_memory_context([r["memory"] for r in raw["results"]])
    # Each call sent its own plan's rid, in every engine's body field.
    rids = [params["extra_body"]["rid"] for _, params in recorder.calls]
    assert len(set(rids)) == 2 and all(r.startswith("cp-") for r in rids)
    for rid, (_, params) in zip(rids, recorder.calls):
        assert params["extra_body"] == dict.fromkeys(REQUEST_ID_FIELDS, rid)
    assert memory.pilot.stats()["requests"] == 2


def test_scope_comes_from_filters_or_context(mem0_memory: Memory) -> None:
    _store(mem0_memory)
    mem0_memory.add("Bob collects stamps.", user_id="bob", infer=False)
    memory = ContextPilotMemory(mem0_memory)
    recorder = PromptRecorder()
    _ask(
        _agent(Mem0MemoryMiddleware(memory, filters={"user_id": "bob"}, search_kwargs=SEARCH)),
        "What does Bob collect?",
        recorder,
    )
    _ask(
        _agent(Mem0MemoryMiddleware(memory, search_kwargs=SEARCH)),
        "Hobbies?",
        recorder,
        user_id="bob",
    )
    for messages, _ in recorder.calls:
        assert messages[0].content == SYSTEM
        assert "Bob collects stamps." in messages[-1].content
        assert not any(fact in messages[-1].content for fact in FACTS)
    with pytest.raises(ValueError, match="no memory scope"):
        _ask(_agent(Mem0MemoryMiddleware(memory)), "Hobbies?", recorder)


def test_no_memory_leaves_the_request_unchanged(mem0_memory: Memory) -> None:
    recorder = PromptRecorder()
    agent = _agent(Mem0MemoryMiddleware(ContextPilotMemory(mem0_memory), search_kwargs=SEARCH))
    state = _ask(agent, "Hello?", recorder, user_id="nobody")
    ((messages, _),) = recorder.calls
    assert messages[0].content == SYSTEM
    assert len(messages) == 2 and messages[1].content == "Hello?"
    assert MEMORY_CHARS_KEY not in state["messages"][0].additional_kwargs


def test_mem0_errors_reach_the_caller(mem0_memory: Memory) -> None:
    agent = _agent(
        Mem0MemoryMiddleware(ContextPilotMemory(mem0_memory), filters={"user_id": "a b"})
    )
    with pytest.raises(ValueError, match="whitespace"):
        _ask(agent, "Hello?", PromptRecorder())


def test_async_agent_with_async_memory(mem0_async_memory: Any) -> None:
    memory = AsyncContextPilotMemory(mem0_async_memory)
    recorder = PromptRecorder()
    agent = _agent(Mem0MemoryMiddleware(memory, search_kwargs=SEARCH))

    async def scenario() -> None:
        for text in FACTS:
            await memory.add(text, user_id="alice", infer=False)
        await agent.ainvoke(
            {"messages": [{"role": "user", "content": "What does Alice drink?"}]},
            context={"user_id": "alice"},
            config={"callbacks": [recorder]},
        )

    asyncio.run(scenario())
    ((messages, _),) = recorder.calls
    assert messages[0].content == SYSTEM
    for text in FACTS:
        assert f"\n{text}\n-----\n" in messages[1].content
    assert messages[1].content.endswith("-----\nWhat does Alice drink?")
    with pytest.raises(TypeError, match="asynchronous"):
        _ask(agent, "What does Alice drink?", recorder, user_id="alice")


def test_bad_arguments_are_named(mem0_memory: Memory) -> None:
    with pytest.raises(TypeError, match="search"):
        Mem0MemoryMiddleware(object())
    with pytest.raises(ValueError, match="top_k"):
        Mem0MemoryMiddleware(mem0_memory, top_k=0)
    with pytest.raises(TypeError, match="filters"):
        Mem0MemoryMiddleware(mem0_memory, filters="alice")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine"):
        Mem0MemoryMiddleware(mem0_memory, engine="sglang-0.5")  # type: ignore[arg-type]
