"""The agent middleware's running totals: conversations keyed by (tenant, thread id), an LRU
of the most recent ones, and one INFO line per model call."""

from __future__ import annotations

import logging

import pytest
from agent_support import SYSTEM, ScriptedChatModel, final, search_call, search_tool, thread
from langchain.agents import create_agent
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from contextpilot_integrations.core.messages import MessagePlanner
from contextpilot_integrations.langchain.agent_middleware import ContextPilotMiddleware


def _run(middleware: ContextPilotMiddleware, documents: list[Document], threads: list[str]) -> None:
    script = []
    for name in threads:
        script += [
            search_call("kv cache prefix", f"{name}-1"),
            search_call("kv cache prefix", f"{name}-2"),
            final(),
        ]
    agent = create_agent(
        ScriptedChatModel(script=script),
        [search_tool(documents)],
        system_prompt=SYSTEM,
        middleware=[middleware],
        checkpointer=InMemorySaver(),
    )
    for name in threads:
        agent.invoke({"messages": [HumanMessage("What is a KV cache?")]}, thread(name))


def test_two_tenants_with_one_thread_id_never_add_up(
    topic_documents: list[Document], caplog: pytest.LogCaptureFixture
) -> None:
    planner = MessagePlanner()
    acme = ContextPilotMiddleware(tenant="acme", planner=planner)
    globex = ContextPilotMiddleware(tenant="globex", planner=planner)
    with caplog.at_level(logging.INFO, logger="contextpilot_integrations.langchain"):
        _run(acme, topic_documents, ["t1"])
        _run(globex, topic_documents, ["t1"])

    for middleware, tenant in ((acme, "acme"), (globex, "globex")):
        stats = middleware.stats()
        overall = {k: v for k, v in stats.items() if k != "conversations"}
        assert stats["conversations"] == {tenant: {"t1": overall}}
        assert overall["calls"] == 3 and overall["new_pointers"] == 1
        assert overall["tokens_removed"] > 0
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 6
    assert sum("tenant='globex' conversation='t1'" in line for line in lines) == 3
    assert "tokens_removed=" in lines[2] and "new_pointers=1" in lines[2]


def test_the_conversations_kept_are_the_most_recent(topic_documents: list[Document]) -> None:
    middleware = ContextPilotMiddleware(tenant="acme", max_conversations=1)
    _run(middleware, topic_documents, ["one", "two"])
    stats = middleware.stats()
    assert stats["calls"] == 6
    assert list(stats["conversations"]) == ["acme"]
    assert list(stats["conversations"]["acme"]) == ["two"]
    assert stats["conversations"]["acme"]["two"]["calls"] == 3
