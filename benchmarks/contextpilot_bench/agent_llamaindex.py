"""Agent sessions replayed through LlamaIndex ``FunctionAgent`` loops.

One ``FunctionAgent`` per session with a memory that keeps the whole session
(``ChatMemoryBuffer``, no token limit in reach), the user turns run in order, the scripted
``FunctionCallingLLM`` (:class:`~contextpilot_bench.agent_models.ScriptedFunctionLLM`) calling
the search tool twice per turn. The search tool is a ``FunctionTool`` rendering the top
documents as the core layout's blocks (``PromptLayout().render_block``: ``[Doc n]``, the text,
the separator line), the layout the LangChain tool renders and the planner reads; a passage's
own blank lines would make ``[n]`` blocks separated by blank lines ambiguous. Methods:
``llamaindex-baseline`` (the scripted LLM itself) and ``llamaindex-contextpilot`` (wrapped in
:class:`~contextpilot_integrations.llama_index.agent_llm.ContextPilotAgentLLM`, bound to the
session). The prompts are what the scripted LLM received, as ``llama-index-llms-openai``
sends them (``to_openai_message_dicts``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from contextpilot_bench.agent_accounting import AgentPrompt
from contextpilot_bench.agent_models import SEARCH_TOOL, ScriptedFunctionLLM
from contextpilot_bench.agent_replay import SEARCH_DESCRIPTION, SYSTEM_PROMPT, AgentRun
from contextpilot_bench.agent_sessions import AgentSession, ScopedBM25Retriever
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


def _render(retriever: ScopedBM25Retriever, query: str) -> str:
    found = retriever.search(query)
    return "".join(_LAYOUT.render_block(n, d.text) for n, d in enumerate(found))


async def _session(method: str, session: AgentSession, index: ScopedBM25) -> tuple[Any, Any]:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.memory import ChatMemoryBuffer
    from llama_index.core.tools import FunctionTool

    from contextpilot_integrations.llama_index.agent_llm import ContextPilotAgentLLM

    retriever = ScopedBM25Retriever(index=index, scope=session.scope)

    def search(query: str) -> str:
        return _render(retriever, query)

    tool = FunctionTool.from_defaults(search, name=SEARCH_TOOL, description=SEARCH_DESCRIPTION)
    inner = ScriptedFunctionLLM(session.turns)
    llm: Any = inner
    if method == "llamaindex-contextpilot":
        llm = ContextPilotAgentLLM(inner, tenant="bench").for_conversation(session.id)
    agent = FunctionAgent(llm=llm, tools=[tool], system_prompt=SYSTEM_PROMPT, streaming=False)
    memory = ChatMemoryBuffer.from_defaults(token_limit=100_000_000)
    for turn in session.turns:
        await agent.run(turn.question, memory=memory)
    return inner, tool


def replay_llamaindex(method: str, sessions: Sequence[AgentSession], index: ScopedBM25) -> AgentRun:
    """Replay ``sessions`` one after the other with ``method``.

    Raises:
        ValueError: an unknown ``method``.
    """
    if method not in LLAMAINDEX_AGENT_METHODS:
        raise ValueError(
            f"method must be one of {', '.join(LLAMAINDEX_AGENT_METHODS)}, got {method!r}"
        )
    from llama_index.llms.openai.utils import to_openai_message_dicts

    run = AgentRun(method)
    for session in sessions:
        inner, tool = asyncio.run(_session(method, session, index))
        schema = tool.metadata.to_openai_tool()
        retriever = ScopedBM25Retriever(index=index, scope=session.scope)
        originals: dict[str, str] = {}
        for call in inner.calls:
            sent = to_openai_message_dicts(list(call.messages))
            messages = tuple(dict(cast("Mapping[str, Any]", m)) for m in sent)
            run.prompts.append(AgentPrompt(session.id, (schema,), messages))
            for message in messages:
                for tool_call in message.get("tool_calls") or ():
                    query = json.loads(tool_call["function"]["arguments"])["query"]
                    originals[tool_call["id"]] = _render(retriever, query)
        run.originals[session.id] = originals
    return run
