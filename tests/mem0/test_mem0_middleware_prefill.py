"""Mem0MemoryMiddleware never invalidates the conversation's prefix: in a tool-using agent over
several user turns every model call's prompt starts with the previous call's whole prompt, one
search per user turn, so the agent's prefill is the prefill without memory plus the memory
tokens (docs/DESIGN.md, "Mem0")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from mem0 import Memory

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.mem0 import ContextPilotMemory
from contextpilot_integrations.mem0.langchain_middleware import (
    MEMORY_CHARS_KEY,
    Mem0MemoryMiddleware,
)

SYSTEM = "You are Alice's assistant. Look things up with the notes tool, then answer."
FACTS = [
    "Alice drinks green tea every morning.",
    "Alice lives in Montreal with her cat Miso.",
    "Alice runs the half marathon every September.",
    "Alice is vegetarian and cooks lentil curry.",
    "Alice plays the cello on Wednesdays.",
    "Alice's brother Tom lives in Shizuoka.",
]
QUESTIONS = [
    "What could I cook tonight?",
    "What should I pack to visit my brother?",
    "Plan my weekend around my routine.",
    "A snack after Wednesday's rehearsal?",
]
TOOL_CALLS = 2  # per user turn
COUNTER = ApproxTokenCounter()


@tool
def notes(query: str) -> str:
    """Looks up the user's notebook."""
    return "\n".join(f"note {i}: what the notebook says about {query!r}" for i in range(12))


class ScriptedToolModel(GenericFakeChatModel):
    """Calls ``notes`` TOOL_CALLS times per user turn, then answers; the reply depends only on
    the number of user messages and of tool results since the latest one, so runs with and
    without memories hold the same conversation."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        # The model settings (extra_body) come as keywords; the script needs no tool schema.
        kwargs.pop("tool_choice", None)
        return self.bind(**kwargs)

    def _generate(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        turn = sum(isinstance(m, HumanMessage) for m in messages)
        done = 0
        for m in reversed(messages):
            if isinstance(m, HumanMessage):
                break
            done += isinstance(m, ToolMessage)
        if done < TOOL_CALLS:
            call = {"name": "notes", "args": {"query": f"{turn}/{done}"}, "id": f"c{turn}{done}"}
            reply = AIMessage(content="", tool_calls=[{**call, "type": "tool_call"}])
        else:
            reply = AIMessage(content=f"Answer {turn}.")
        return ChatResult(generations=[ChatGeneration(message=reply)])


class PromptRecorder(BaseCallbackHandler):
    """The messages and invocation parameters of every chat model call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[BaseMessage], dict[str, Any]]] = []

    def on_chat_model_start(
        self, serialized: dict[str, Any], messages: list[list[BaseMessage]], **kwargs: Any
    ) -> None:
        self.calls.append((messages[0], kwargs.get("invocation_params") or {}))


def serialize(messages: Sequence[BaseMessage]) -> str:
    """A call's messages as the text an engine prefills, in order."""
    parts = []
    for m in messages:
        calls = json.dumps(getattr(m, "tool_calls", None) or [], sort_keys=True)
        parts.append(f"<{m.type}>{m.content}|{calls}|{getattr(m, 'tool_call_id', '')}\n")
    return "".join(parts)


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefill_tokens(prompts: Sequence[str]) -> int:
    """Summed over the calls: prompt tokens minus those of the longest common prefix with the
    previous call's prompt (what a prefix cache reuses)."""
    total, previous = 0, ""
    for text in prompts:
        total += COUNTER.count(text) - COUNTER.count(text[: common_prefix(previous, text)])
        previous = text
    return total


def converse(middleware: list[Any], mode: str) -> tuple[PromptRecorder, list[Any]]:
    """The user's turns, the application passing the returned messages back each turn."""
    agent = create_agent(
        ScriptedToolModel(messages=iter(())),
        tools=[notes],
        system_prompt=SYSTEM,
        middleware=middleware,
    )
    recorder = PromptRecorder()
    history: list[Any] = []
    for question in QUESTIONS:
        request = {"messages": [*history, {"role": "user", "content": question}]}
        config: Any = {"callbacks": [recorder]}
        if mode == "sync":
            state = agent.invoke(request, context={"user_id": "alice"}, config=config)
        else:
            state = asyncio.run(agent.ainvoke(request, context={"user_id": "alice"}, config=config))
        history = state["messages"]
    return recorder, history


def _counted_searches(memory: Memory, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The queries of every Mem0 search from now on (a wrapped memory searches Mem0 too)."""
    queries: list[str] = []
    search = memory.search

    def counted(query: str, **kwargs: Any) -> Any:
        queries.append(query)
        return search(query, **kwargs)

    monkeypatch.setattr(memory, "search", counted)
    return queries


def _stored(memory: Memory) -> None:
    for text in FACTS:
        memory.add(text, user_id="alice", infer=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["plain", "wrapped"])
def test_memories_cost_their_tokens_once(
    mem0_memory: Memory, monkeypatch: pytest.MonkeyPatch, kind: str, mode: str
) -> None:
    _stored(mem0_memory)
    searches = _counted_searches(mem0_memory, monkeypatch)
    memory = ContextPilotMemory(mem0_memory) if kind == "wrapped" else mem0_memory
    middleware = Mem0MemoryMiddleware(memory, search_kwargs={"threshold": 0.0}, engine="any")
    with_memory, history = converse([middleware], mode)
    without, bare_history = converse([], mode)

    calls_per_turn = TOOL_CALLS + 1
    assert len(with_memory.calls) == len(without.calls) == len(QUESTIONS) * calls_per_turn
    assert searches == QUESTIONS  # once per user turn, never in the tool loop
    prompts = [serialize(messages) for messages, _ in with_memory.calls]
    for (messages, _), previous, prompt in zip(with_memory.calls, [""] + prompts, prompts):
        assert messages[0].content == SYSTEM  # the system message never changes
        assert prompt.startswith(previous)  # no call invalidates the previous call's prefix
    # Each user message carries its turn's memory context, then the user's own text.
    asked = [m for m in history if isinstance(m, HumanMessage)]
    contexts = [m.content[: m.additional_kwargs[MEMORY_CHARS_KEY]] for m in asked]
    assert [m.content[len(c) :] for m, c in zip(asked, contexts)] == QUESTIONS
    assert all("Alice" in c for c in contexts)
    assert [type(m) for m in history] == [type(m) for m in bare_history]

    memory_tokens = sum(COUNTER.count(c) for c in contexts)
    bare = prefill_tokens([serialize(messages) for messages, _ in without.calls])
    ratio = prefill_tokens(prompts) / (bare + memory_tokens)
    print(f"{kind} {mode}: prefill / (without memory + memory tokens) = {ratio:.3f}")
    assert ratio <= 1.05

    # A wrapped memory's plan rid goes with the call it was made for, the turn's first.
    rids = [params.get("extra_body", {}).get("rid") for _, params in with_memory.calls]
    firsts = rids[::calls_per_turn]
    if kind == "wrapped":
        assert len(set(firsts)) == len(QUESTIONS) and all(r.startswith("cp-") for r in firsts)
    else:
        assert firsts == [None] * len(QUESTIONS)
    assert [r for i, r in enumerate(rids) if i % calls_per_turn] == [None] * (
        len(rids) - len(QUESTIONS)
    )


def test_a_turn_without_memories_is_searched_once(
    mem0_memory: Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    searches = _counted_searches(mem0_memory, monkeypatch)
    middleware = Mem0MemoryMiddleware(mem0_memory, search_kwargs={"threshold": 0.0})
    _, history = converse([middleware], "sync")
    assert searches == QUESTIONS  # nothing stored: nothing found, and no search in the loop
    assert all(MEMORY_CHARS_KEY not in m.additional_kwargs for m in history)
    assert [m.content for m in history if isinstance(m, HumanMessage)] == QUESTIONS


def test_a_list_content_gets_the_context_as_its_first_block(mem0_memory: Memory) -> None:
    _stored(mem0_memory)
    agent = create_agent(
        ScriptedToolModel(messages=iter(())),
        tools=[notes],
        system_prompt=SYSTEM,
        middleware=[Mem0MemoryMiddleware(mem0_memory, search_kwargs={"threshold": 0.0})],
    )
    question = [{"type": "text", "text": "What does Alice drink?"}]
    state = agent.invoke(
        {"messages": [HumanMessage(content=question)]}, context={"user_id": "alice"}
    )
    asked = state["messages"][0]
    first, *rest = asked.content
    assert rest == question
    assert first["type"] == "text" and "Alice drinks green tea" in first["text"]
    assert asked.additional_kwargs[MEMORY_CHARS_KEY] == len(first["text"])
