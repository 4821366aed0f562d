"""Agent sessions replayed through LlamaIndex ``FunctionAgent`` loops.

One ``FunctionAgent`` per session with a memory that keeps the whole session
(``ChatMemoryBuffer``, no token limit in reach), the user turns run in order, the scripted
``FunctionCallingLLM`` (:class:`~contextpilot_bench.agent_models.ScriptedFunctionLLM`) making
each turn's tool calls. A file session's tools are ``FunctionTool`` s over its own
:class:`~contextpilot_bench.agent_workspace.Workspace` copy. The search tool is a
``FunctionTool`` rendering the top
documents as the core layout's blocks (``PromptLayout().render_block``: ``[Doc n]``, the text,
the separator line), the layout the LangChain tool renders and the planner reads; a passage's
own blank lines would make ``[n]`` blocks separated by blank lines ambiguous. Methods:
``llamaindex-baseline`` (the scripted LLM itself) and ``llamaindex-contextpilot`` (wrapped in
:class:`~contextpilot_integrations.llama_index.agent_llm.ContextPilotAgentLLM`, bound to the
session). The prompts are what the scripted LLM received, as ``llama-index-llms-openai``
sends them (``to_openai_message_dicts``); the tools' outputs by call id are those calls run
again in order on a fresh copy of the session's tools (the same outputs: the tools are
deterministic).
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from contextpilot_bench.agent_accounting import AgentPrompt
from contextpilot_bench.agent_models import ScriptedFunctionLLM
from contextpilot_bench.agent_replay import SEARCH_DESCRIPTION, SYSTEM_PROMPT, AgentRun
from contextpilot_bench.agent_sessions import SEARCH_TOOL, AgentSession, ScopedBM25Retriever
from contextpilot_bench.agent_workspace import (
    EDIT_TOOL,
    FILE_SYSTEM_PROMPT,
    FILE_TOOL_DESCRIPTIONS,
    READ_TOOL,
    SEARCH_FILES_TOOL,
    Workspace,
)
from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_integrations.core.rendering import PromptLayout

__all__ = ["LLAMAINDEX_AGENT_METHODS", "llamaindex_unavailable", "replay_llamaindex"]

LLAMAINDEX_AGENT_METHODS = ("llamaindex-baseline", "llamaindex-contextpilot")


def llamaindex_unavailable() -> str | None:
    """Why the LlamaIndex replay cannot run here (a missing module), or ``None``."""
    for module in (
        "llama_index.core.agent.workflow",
        "llama_index.llms.openai.utils",
        "contextpilot_integrations.llama_index.agent_llm",
    ):
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 (any import failure means: skip, say why)
            return f"{module}: {type(error).__name__}: {error}"
    return None


_LAYOUT = PromptLayout()


def _functions(session: AgentSession, index: ScopedBM25 | None) -> dict[str, Callable[..., str]]:
    """A fresh copy of the session's tool functions by tool name."""
    if session.files:
        workspace = Workspace(session.files)
        return {
            READ_TOOL: workspace.read_file,
            EDIT_TOOL: workspace.edit_file,
            SEARCH_FILES_TOOL: workspace.search_files,
        }
    if index is None:
        raise ValueError(f"session {session.id} searches, so index must be a ScopedBM25")
    retriever = ScopedBM25Retriever(index=index, scope=session.scope)

    def search(query: str) -> str:
        found = retriever.search(query)
        return "".join(_LAYOUT.render_block(n, d.text) for n, d in enumerate(found))

    return {SEARCH_TOOL: search}


async def _session(
    method: str, session: AgentSession, index: ScopedBM25 | None
) -> tuple[Any, list[Any]]:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.memory import ChatMemoryBuffer
    from llama_index.core.tools import FunctionTool

    from contextpilot_integrations.llama_index.agent_llm import ContextPilotAgentLLM

    tools: list[Any] = [
        FunctionTool.from_defaults(
            function, name=name, description=FILE_TOOL_DESCRIPTIONS.get(name, SEARCH_DESCRIPTION)
        )
        for name, function in _functions(session, index).items()
    ]
    inner = ScriptedFunctionLLM(session.turns)
    llm: Any = inner
    if method == "llamaindex-contextpilot":
        llm = ContextPilotAgentLLM(inner, tenant="bench").for_conversation(session.id)
    system = FILE_SYSTEM_PROMPT if session.files else SYSTEM_PROMPT
    agent = FunctionAgent(llm=llm, tools=tools, system_prompt=system, streaming=False)
    memory = ChatMemoryBuffer.from_defaults(token_limit=100_000_000)
    for turn in session.turns:
        await agent.run(turn.question, memory=memory)
    return inner, tools


def replay_llamaindex(
    method: str, sessions: Sequence[AgentSession], index: ScopedBM25 | None
) -> AgentRun:
    """Replay ``sessions`` one after the other with ``method`` (``index``: the search
    sessions' retrieval index, ``None`` when every session is a file session).

    Raises:
        ValueError: an unknown ``method``, or a search session without ``index``.
    """
    if method not in LLAMAINDEX_AGENT_METHODS:
        raise ValueError(
            f"method must be one of {', '.join(LLAMAINDEX_AGENT_METHODS)}, got {method!r}"
        )
    from llama_index.llms.openai.utils import to_openai_message_dicts

    run = AgentRun(method)
    for session in sessions:
        inner, tools = asyncio.run(_session(method, session, index))
        schemas = tuple(tool.metadata.to_openai_tool() for tool in tools)
        functions = _functions(session, index)
        originals: dict[str, str] = {}
        for call in inner.calls:
            sent = to_openai_message_dicts(list(call.messages))
            messages = tuple(dict(cast("Mapping[str, Any]", m)) for m in sent)
            run.prompts.append(AgentPrompt(session.id, schemas, messages))
            for message in messages:
                for tool_call in message.get("tool_calls") or ():
                    if tool_call["id"] not in originals:
                        function = tool_call["function"]
                        arguments = json.loads(function["arguments"])
                        originals[tool_call["id"]] = functions[function["name"]](**arguments)
        run.originals[session.id] = originals
    return run
