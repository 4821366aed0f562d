"""The LlamaIndex agent LLM's running totals: copies bound to two tenants that use the same
conversation id are two conversations, the most recent ones kept."""

from __future__ import annotations

import logging

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms.mock import MockFunctionCallingLLM

from contextpilot_integrations.llama_index import ContextPilotAgentLLM


def _history() -> list[ChatMessage]:
    result = "\n\n".join(f"[Doc {i}] " + " ".join(f"w{i}-{w}" for w in range(60)) for i in (1, 2))
    call = {
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "q"}'},
            }
        ]
    }
    again = {
        "tool_calls": [
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "q"}'},
            }
        ]
    }
    return [
        ChatMessage(role=MessageRole.USER, content="question"),
        ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs=call),
        ChatMessage(
            role=MessageRole.TOOL, content=result, additional_kwargs={"tool_call_id": "c1"}
        ),
        ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs=again),
        ChatMessage(
            role=MessageRole.TOOL, content=result, additional_kwargs={"tool_call_id": "c2"}
        ),
    ]


def test_two_tenants_with_one_conversation_id_never_add_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    llm = ContextPilotAgentLLM(MockFunctionCallingLLM())
    alice, bob = (
        llm.for_conversation("c-1", tenant="alice"),
        llm.for_conversation("c-1", tenant="bob"),
    )
    with caplog.at_level(logging.INFO, logger="contextpilot_integrations.llama_index.agent_llm"):
        alice.plan_messages(_history())
        alice.plan_messages(_history())
        bob.plan_messages(_history())
    stats = llm.stats()
    assert stats["calls"] == 3
    conversations = stats["conversations"]
    assert conversations.keys() == {"alice", "bob"}
    first, second = conversations["alice"]["c-1"], conversations["bob"]["c-1"]
    assert (first["calls"], second["calls"]) == (2, 1)
    assert second["tokens_removed"] > 0 and first["tokens_removed"] == 2 * second["tokens_removed"]
    assert stats["tokens_removed"] == first["tokens_removed"] + second["tokens_removed"]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 3 and "tenant='bob' conversation='c-1'" in lines[2]
    assert f"tokens_removed={second['tokens_removed']}" in lines[2]


def test_the_conversations_kept_are_the_most_recent() -> None:
    llm = ContextPilotAgentLLM(MockFunctionCallingLLM(), tenant="acme", max_conversations=2)
    for name in ("one", "two", "three"):
        llm.for_conversation(name).plan_messages(_history())
    stats = llm.stats()
    assert stats["calls"] == 3
    assert stats["conversations"] == {
        "acme": {name: stats["conversations"]["acme"][name] for name in ("two", "three")}
    }
    assert list(stats["conversations"]["acme"]) == ["two", "three"]
