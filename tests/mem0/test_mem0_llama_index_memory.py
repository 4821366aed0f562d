"""Mem0MemoryBlock in LlamaIndex's Memory and a real chat engine (MockLLM echoes its prompt)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.llms import MockLLM
from llama_index.core.memory import Memory as LlamaMemory
from mem0 import Memory

from contextpilot_integrations.mem0 import (
    MEMORY_LAYOUT,
    AsyncContextPilotMemory,
    ContextPilotMemory,
)
from contextpilot_integrations.mem0.layout import plain_memory_context
from contextpilot_integrations.mem0.llama_index_memory import Mem0MemoryBlock

FACTS = [
    "Alice drinks green tea every morning.",
    "Alice lives in Montreal with her cat Miso.",
    "Alice runs the half marathon every September.",
]
SYSTEM = "You are Alice's assistant."
SEARCH = {"threshold": 0.0}


def _store(memory: Any) -> None:
    for text in FACTS:
        memory.add(text, user_id="alice", infer=False)


def _engine(block: Mem0MemoryBlock, session: str) -> SimpleChatEngine:
    memory = LlamaMemory.from_defaults(session_id=session, memory_blocks=[block])
    return SimpleChatEngine.from_defaults(llm=MockLLM(), memory=memory, system_prompt=SYSTEM)


def test_chat_engine_prompt_is_system_memories_history(mem0_memory: Memory) -> None:
    _store(mem0_memory)
    memory = ContextPilotMemory(mem0_memory)
    block = Mem0MemoryBlock(memory=memory, filters={"user_id": "alice"}, search_kwargs=SEARCH)
    engine = _engine(block, "s1")
    # MockLLM answers with the prompt it was given (messages as "role: content" lines).
    prompt = str(engine.chat("What does Alice drink?"))
    system, rest = prompt.split(f"system: {MEMORY_LAYOUT.system_prompt}\n", 1)
    assert system == f"system: {SYSTEM}\n"
    context, question = rest.split("\nuser: ", 1)
    assert question.startswith("What does Alice drink?")
    for text in FACTS:
        assert f"\n{text}\n-----\n" in context
    assert block.last_rid is not None and block.last_rid.startswith("cp-")
    second = str(engine.chat("Where does Alice live with her cat?"))
    # The second turn's memories come first in the first turn's order (shared prefix), and the
    # annotation gives Mem0's ranking, which differs.
    assert second.startswith(f"system: {SYSTEM}\nsystem: {MEMORY_LAYOUT.system_prompt}\n{context}")
    assert "Most relevant memories first: [Memory" in second


def test_plain_memory_block_renders_mem0_order(mem0_memory: Memory) -> None:
    _store(mem0_memory)
    block = Mem0MemoryBlock(memory=mem0_memory, filters={"user_id": "alice"}, search_kwargs=SEARCH)
    question = [ChatMessage(role=MessageRole.USER, content="What does Alice drink?")]
    (message,) = asyncio.run(block.aget(question))
    raw = mem0_memory.search("What does Alice drink?", filters={"user_id": "alice"}, **SEARCH)
    assert message.role == MessageRole.SYSTEM
    assert message.content == plain_memory_context([r["memory"] for r in raw["results"]])
    assert block.last_rid is None
    assert asyncio.run(block.aget([])) == []


def test_flushed_messages_are_added_to_mem0(mem0_memory: Memory) -> None:
    block = Mem0MemoryBlock(
        memory=ContextPilotMemory(mem0_memory),
        filters={"user_id": "alice", "agent_id": "helper"},
        infer=False,
    )
    asyncio.run(
        block.aput(
            [
                ChatMessage(role=MessageRole.SYSTEM, content="ignored"),
                ChatMessage(role=MessageRole.USER, content="I adopted a second cat, Tofu."),
                ChatMessage(role=MessageRole.ASSISTANT, content="Congratulations on Tofu!"),
                ChatMessage(role=MessageRole.USER, content="  "),
            ],
            from_short_term_memory=True,
        )
    )
    stored = mem0_memory.get_all(filters={"user_id": "alice", "agent_id": "helper"})["results"]
    assert sorted(m["memory"] for m in stored) == [
        "Congratulations on Tofu!",
        "I adopted a second cat, Tofu.",
    ]


def test_async_memory(mem0_async_memory: Any) -> None:
    memory = AsyncContextPilotMemory(mem0_async_memory)
    block = Mem0MemoryBlock(memory=memory, filters={"user_id": "alice"}, search_kwargs=SEARCH)

    async def scenario() -> list[ChatMessage]:
        for text in FACTS:
            await memory.add(text, user_id="alice", infer=False)
        return await block.aget([ChatMessage(role=MessageRole.USER, content="tea?")])

    (message,) = asyncio.run(scenario())
    assert all(text in message.content for text in FACTS)


def test_filters_need_a_scope(mem0_memory: Memory) -> None:
    with pytest.raises(ValueError, match="user_id"):
        Mem0MemoryBlock(memory=mem0_memory, filters={"category": "food"})
