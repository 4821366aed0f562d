"""Agent sessions replayed through real ``langchain.agents.create_agent`` loops.

One agent per session (thread id = the session id, ``InMemorySaver`` checkpointer), the
session's user turns invoked in order; the scripted model (:mod:`~contextpilot_bench.agent_models`)
makes each turn's tool calls and answers. A search session's agent has the search tool, a file
session's the tools of its own :class:`~contextpilot_bench.agent_workspace.Workspace` copy
(``StructuredTool`` over its methods, the same in every method). The methods differ only in the
search tool and the middleware:

``baseline``
    ``create_retriever_tool`` (the documents' texts joined by blank lines), no middleware.
``contextpilot``
    ``retriever_tool`` (labelled documents,
    :mod:`contextpilot_integrations.langchain.retriever_tool`) and ``ContextPilotMiddleware``
    (``engine="openai-compatible"``, :mod:`contextpilot_integrations.langchain.agent_middleware`);
    a file session keeps the file tools.
``anthropic-caching``
    the baseline on ``ChatAnthropic`` with LangChain's ``AnthropicPromptCachingMiddleware``
    (system message, last tool and the message tail marked).
``contextpilot-anthropic``
    ``contextpilot`` on ``ChatAnthropic`` with ``engine="anthropic"`` (the library's one
    breakpoint on the newest stable prefix).
``contextpilot-anthropic+caching``
    the same with ``AnthropicPromptCachingMiddleware`` listed before it (outer), as the
    middleware's docstring says to combine them.

What each model call received is recorded
(:func:`~contextpilot_bench.agent_accounting.langchain_prompt`) with the tools' own outputs by
call id (from the agent's state), for the pointer check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain.agents import create_agent
from langchain_anthropic.middleware import AnthropicPromptCachingMiddleware
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool, create_retriever_tool
from langgraph.checkpoint.memory import InMemorySaver

from contextpilot_bench.agent_accounting import AgentPrompt, langchain_prompt
from contextpilot_bench.agent_models import ScriptedAnthropicModel, ScriptedChatModel
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
from contextpilot_integrations.langchain.agent_middleware import (
    AgentEngine,
    ContextPilotMiddleware,
)
from contextpilot_integrations.langchain.retriever_tool import retriever_tool

__all__ = [
    "ANTHROPIC_MODEL",
    "HOSTED_AGENT_METHODS",
    "LANGCHAIN_AGENT_METHODS",
    "SEARCH_DESCRIPTION",
    "SYSTEM_PROMPT",
    "AgentRun",
    "replay_langchain",
]

LANGCHAIN_AGENT_METHODS = ("baseline", "contextpilot")
HOSTED_AGENT_METHODS = (
    "anthropic-caching",
    "contextpilot-anthropic",
    "contextpilot-anthropic+caching",
)
ANTHROPIC_MODEL = "claude-sonnet-4-5"
"""The model id the Anthropic methods name (its minimum cacheable prefix applies)."""
SYSTEM_PROMPT = (
    "You are a research assistant. Search the document collection before you answer: call the "
    "search tool with the question, then with a follow-up query, and answer from the "
    "documents it returns, citing them."
)
SEARCH_DESCRIPTION = "Search the document collection; returns the most relevant documents."


@dataclass
class AgentRun:
    """One method's replay: every model call's prompt in call order, and the tools' outputs
    by call id per session (``{session: {call id: text}}``)."""

    method: str
    prompts: list[AgentPrompt] = field(default_factory=list)
    originals: dict[str, dict[str, str]] = field(default_factory=dict)


def _file_tools(workspace: Workspace) -> list[BaseTool]:
    """LangChain tools over ``workspace``'s methods (read, edit, search), in that order."""
    methods: dict[str, Callable[..., str]] = {
        READ_TOOL: workspace.read_file,
        EDIT_TOOL: workspace.edit_file,
        SEARCH_FILES_TOOL: workspace.search_files,
    }
    return [
        StructuredTool.from_function(m, name=n, description=FILE_TOOL_DESCRIPTIONS[n])
        for n, m in methods.items()
    ]


def _tools(method: str, session: AgentSession, index: ScopedBM25 | None) -> list[BaseTool]:
    if session.files:
        return _file_tools(Workspace(session.files))
    if index is None:
        raise ValueError(f"session {session.id} searches, so index must be a ScopedBM25")
    retriever = ScopedBM25Retriever(index=index, scope=session.scope)
    if method.startswith("contextpilot"):
        return [retriever_tool(retriever, SEARCH_TOOL, SEARCH_DESCRIPTION)]
    return [create_retriever_tool(retriever, SEARCH_TOOL, SEARCH_DESCRIPTION)]


def _agent(method: str, session: AgentSession, index: ScopedBM25 | None) -> tuple[Any, Any]:
    """The agent and its scripted model for one session."""
    pilot = method.startswith("contextpilot")
    anthropic = method in HOSTED_AGENT_METHODS
    model: ScriptedChatModel | ScriptedAnthropicModel
    if anthropic:
        # No request leaves the process: the key is never sent.
        fields = {"model": ANTHROPIC_MODEL, "api_key": "unused", "script": session.turns}
        model = ScriptedAnthropicModel.model_validate(fields)
    else:
        model = ScriptedChatModel(script=session.turns)
    middleware: list[Any] = []
    if method in ("anthropic-caching", "contextpilot-anthropic+caching"):
        middleware.append(AnthropicPromptCachingMiddleware(unsupported_model_behavior="raise"))
    if pilot:
        engine: AgentEngine = "anthropic" if anthropic else "openai-compatible"
        middleware.append(ContextPilotMiddleware(tenant="bench", engine=engine))
    agent = create_agent(
        model,
        _tools(method, session, index),
        system_prompt=FILE_SYSTEM_PROMPT if session.files else SYSTEM_PROMPT,
        middleware=middleware,
        checkpointer=InMemorySaver(),
    )
    return agent, model


def replay_langchain(
    method: str, sessions: Sequence[AgentSession], index: ScopedBM25 | None
) -> AgentRun:
    """Replay ``sessions`` one after the other with ``method`` (``index``: the search
    sessions' retrieval index, ``None`` when every session is a file session).

    Raises:
        ValueError: an unknown ``method``, or a search session without ``index``.
    """
    if method not in (*LANGCHAIN_AGENT_METHODS, *HOSTED_AGENT_METHODS):
        raise ValueError(
            f"method must be one of {', '.join((*LANGCHAIN_AGENT_METHODS, *HOSTED_AGENT_METHODS))}"
            f", got {method!r}"
        )
    run = AgentRun(method)
    for session in sessions:
        agent, model = _agent(method, session, index)
        config = {"configurable": {"thread_id": session.id}}
        state: dict[str, Any] = {}
        for turn in session.turns:
            state = agent.invoke({"messages": [HumanMessage(turn.question)]}, config)
        run.prompts += [langchain_prompt(session.id, c.messages, c.kwargs) for c in model.calls]
        run.originals[session.id] = {
            m.tool_call_id: str(m.content)
            for m in state.get("messages", ())
            if isinstance(m, ToolMessage)
        }
    return run
