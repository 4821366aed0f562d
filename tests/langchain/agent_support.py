"""Helpers for the agent tests: a scripted tool-calling chat model (deterministic), search
calls and tools, checks on what the model received (byte-stable prefix, no dangling pointer)
and a small OpenAI-compatible app that answers with scripted tool calls."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_support import Bm25sRetriever
from pydantic import PrivateAttr

from contextpilot_integrations.langchain.retriever_tool import retriever_tool

SYSTEM = "You answer questions about serving LLMs. Search before you answer."


POINTER = re.compile(
    r"\[Same (?:result as|as document .+? of|as the result of) "
    r"(?P<call>\w+\(.*?\)) above\.\]"
)


class ScriptedChatModel(BaseChatModel):
    """Answers call ``i`` with ``script[i]``; records the messages and call keywords."""

    script: list[AIMessage]
    extra_body: dict[str, Any] | None = None
    _calls: list[tuple[list[BaseMessage], dict[str, Any]]] = PrivateAttr(default_factory=list)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    @property
    def calls(self) -> list[tuple[list[BaseMessage], dict[str, Any]]]:
        return self._calls

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> Any:
        return self.bind(
            tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice, **kwargs
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        with self._lock:
            index = len(self._calls)
            self._calls.append((list(messages), kwargs))
        return ChatResult(generations=[ChatGeneration(message=self.script[index].model_copy())])


def search_call(query: str, call_id: str) -> AIMessage:
    return AIMessage(
        content="",
        tool_calls=[
            {"name": "search", "args": {"query": query}, "id": call_id, "type": "tool_call"}
        ],
    )


def final(text: str = "Done.") -> AIMessage:
    return AIMessage(content=text)


def search_tool(documents: list[Document]) -> BaseTool:
    return retriever_tool(
        Bm25sRetriever(documents=documents, k=3),
        "search",
        "Search the notes on LLM serving.",
    )


def serialized(messages: Sequence[BaseMessage]) -> list[str]:
    return [json.dumps(m.model_dump(), sort_keys=True, default=str) for m in messages]


def assert_prefix_stable(calls: Sequence[Sequence[BaseMessage]]) -> None:
    """Every call's messages start with exactly the previous call's."""
    for before, after in zip(calls, calls[1:], strict=False):
        assert serialized(after)[: len(before)] == serialized(before)


def pointers_in(messages: Sequence[BaseMessage]) -> list[tuple[int, str]]:
    return [
        (i, match.group("call"))
        for i, m in enumerate(messages)
        if isinstance(m, ToolMessage) and isinstance(m.content, str)
        for match in POINTER.finditer(m.content)
    ]


def assert_no_dangling(messages: Sequence[BaseMessage], artifacts: dict[str, Any]) -> int:
    """Each pointer in ``messages`` names a call made earlier in them whose result stands there
    in full, and every document a pointing result returned (its artifact, by call id in
    ``artifacts``) stands either in that result itself or in a result one of its pointers names.
    Returns the number of pointers."""
    found = pointers_in(messages)
    targets: dict[int, list[str]] = {}
    for index, call in found:
        pointing = messages[index]
        assert isinstance(pointing, ToolMessage)
        results = {m.tool_call_id: m for m in messages[:index] if isinstance(m, ToolMessage)}
        named = [
            results[c["id"]]
            for m in messages[:index]
            if isinstance(m, AIMessage)
            for c in m.tool_calls
            if f"{c['name']}({json.dumps(c['args'], ensure_ascii=False)})" == call
            and c["id"] in results
        ]
        assert named, f"pointer {call} names no earlier call with a result in the request"
        target = named[0]
        assert isinstance(target.content, str) and not POINTER.search(target.content)
        targets.setdefault(index, []).append(target.content)
    for index, named_texts in targets.items():
        pointing = messages[index]
        assert isinstance(pointing, ToolMessage) and isinstance(pointing.content, str)
        for document in artifacts[pointing.tool_call_id]:
            # A checkpointer hands artifacts back as dicts.
            text = document["page_content"] if isinstance(document, dict) else document.page_content
            assert text in pointing.content or any(text in t for t in named_texts), (
                "the pointer stands for text not there"
            )
    return len(found)


def artifacts_of(messages: Sequence[BaseMessage]) -> dict[str, Any]:
    return {m.tool_call_id: m.artifact for m in messages if isinstance(m, ToolMessage)}


def thread(name: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": name}}


def scripted_server(replies: list[dict[str, Any]], bodies: list[dict[str, Any]]) -> FastAPI:
    """An OpenAI-compatible chat server that records each body and answers reply ``i``."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        bodies.append(body)
        return {
            "id": f"chatcmpl-{len(bodies)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": replies[len(bodies) - 1], "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
        }

    return app


def tool_call_reply(query: str, call_id: str) -> dict[str, Any]:
    arguments = json.dumps({"query": query})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "search", "arguments": arguments},
            }
        ],
    }
