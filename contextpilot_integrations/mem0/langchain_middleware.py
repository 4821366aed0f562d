"""A LangChain agent middleware that puts Mem0 memories in front of every model call.

For ``langchain.agents.create_agent`` (langchain 1.x). Before each model call
(``wrap_model_call`` / ``awrap_model_call``) the middleware searches the memory with the latest
user message and sends the model, in this order (DESIGN.md, "Prompt layout"):

1. one system message: the agent's own system prompt, then the memory context (memory system
   prompt, the memories as labelled documents, location hints, order annotation);
2. the conversation's messages, unchanged.

The memory context is rebuilt for each call and is never written to the agent's state. With a
:class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory` the memories are aligned
against the shared index, so the system prompt and the memories that recent calls placed first
form a prefix the engine's cache already holds; with a plain ``mem0.Memory`` they come in Mem0's
order. Changing one line, ``memory = ContextPilotMemory(memory)``, switches between the two.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, get_args

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.llm_call.engine_fields import EngineKind, with_engine_fields
from contextpilot_integrations.mem0.context import (
    MemoryContext,
    asearch_memory_context,
    search_memory_context,
)
from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT
from contextpilot_integrations.mem0.scope import ENTITY_KEYS

__all__ = ["Mem0MemoryMiddleware"]

Filters = Mapping[str, Any] | Callable[[ModelRequest], Mapping[str, Any]]


def _latest_user_text(messages: Sequence[BaseMessage]) -> str | None:
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            text = message.text
            return text if text.strip() else None
    return None


def _filters_from_context(context: Any) -> dict[str, Any]:
    if isinstance(context, Mapping):
        found = {k: context[k] for k in ENTITY_KEYS if context.get(k) is not None}
    else:
        found = {k: getattr(context, k) for k in ENTITY_KEYS if getattr(context, k, None)}
    if not found:
        raise ValueError(
            "Mem0MemoryMiddleware: no memory scope: pass filters={'user_id': ...} to the "
            "middleware, or invoke the agent with context={'user_id': ...} (user_id, agent_id "
            f"or run_id); the runtime context is {context!r:.200}"
        )
    return found


class Mem0MemoryMiddleware(AgentMiddleware):
    """Injects Mem0 memories before the conversation messages of every model call.

    Args:
        memory: a :class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory` /
            :class:`~contextpilot_integrations.mem0.memory.AsyncContextPilotMemory`, or a plain
            ``mem0.Memory`` / ``mem0.AsyncMemory``. A synchronous memory serves both ``invoke``
            and ``ainvoke`` (the latter in a worker thread); an asynchronous one only
            ``ainvoke``.
        filters: the Mem0 scope: a dict (``{"user_id": "alice"}``) or a function of the
            ``ModelRequest``; default: ``user_id`` / ``agent_id`` / ``run_id`` read from the
            runtime context (``agent.invoke(..., context={"user_id": "alice"})``).
        top_k: memories per search.
        search_kwargs: other arguments for Mem0's ``search`` (``threshold``, ``rerank``, ...).
        layout: the layout for a plain memory (a wrapped one uses its pilot's).
        engine: send the plan's rid to this engine when the memory is wrapped: its body
            fields (:func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields`;
            ``"any"``: SGLang's and vLLM's) are merged into the call's
            ``model_settings["extra_body"]`` (for ``langchain_openai.ChatOpenAI`` on an
            OpenAI-compatible server), so the engine's cache events name the plan's request.
            ``None`` (default): model settings unchanged (a model that takes no
            ``extra_body``).

    Raises:
        TypeError: ``memory`` has no ``search``; ``filters`` neither a dict nor a function.
        ValueError: ``top_k < 1``; an unknown ``engine``.
        Per model call: ValueError, no scope (no ``filters`` and none in the runtime
        context); whatever Mem0's ``search`` raises.
    """

    def __init__(
        self,
        memory: Any,
        *,
        filters: Filters | None = None,
        top_k: int = 20,
        search_kwargs: Mapping[str, Any] | None = None,
        layout: PromptLayout = MEMORY_LAYOUT,
        engine: EngineKind | None = None,
    ) -> None:
        super().__init__()
        if not callable(getattr(memory, "search", None)):
            raise TypeError(
                f"memory must be a Mem0 memory (with search()), got {type(memory).__name__}"
            )
        if filters is not None and not (isinstance(filters, Mapping) or callable(filters)):
            raise TypeError(
                f"filters must be a dict, a function of the ModelRequest or None, got {filters!r}"
            )
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if engine is not None and engine not in get_args(EngineKind):
            raise ValueError(
                f"engine must be one of {get_args(EngineKind)} or None, got {engine!r}"
            )
        self.memory = memory
        self.filters = filters
        self.top_k = top_k
        self.search_kwargs = dict(search_kwargs or {})
        self.layout = layout
        self.engine = engine

    # ------------------------------------------------------------------ hooks
    def wrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], ModelResponse],
    ) -> ModelResponse:
        """Search the memory with the latest user message and call the model with the memory
        context in the system message (the request is unchanged when there is no user message
        or no memory)."""
        query = _latest_user_text(request.messages)
        if query is None:
            return handler(request)
        found = search_memory_context(
            self.memory, query, self._scope(request), layout=self.layout, **self._search_args()
        )
        return handler(self._with_memories(request, found))

    async def awrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        """Async :meth:`wrap_model_call`."""
        query = _latest_user_text(request.messages)
        if query is None:
            return await handler(request)
        found = await asearch_memory_context(
            self.memory, query, self._scope(request), layout=self.layout, **self._search_args()
        )
        return await handler(self._with_memories(request, found))

    # ------------------------------------------------------------------ helpers
    def _search_args(self) -> dict[str, Any]:
        return {**self.search_kwargs, "top_k": self.top_k}

    def _scope(self, request: ModelRequest) -> dict[str, Any]:
        if self.filters is None:
            runtime = request.runtime
            return _filters_from_context(getattr(runtime, "context", None))
        if isinstance(self.filters, Mapping):
            return dict(self.filters)
        scope = self.filters(request)
        if not isinstance(scope, Mapping):
            raise TypeError(f"the filters function must return a dict, got {scope!r:.200}")
        return dict(scope)

    def _with_memories(self, request: ModelRequest, found: MemoryContext) -> ModelRequest:
        if not found.text:
            return request
        own = request.system_message.text if request.system_message is not None else ""
        content = f"{own}\n\n{found.text}" if own else found.text
        overrides: dict[str, Any] = {"system_message": SystemMessage(content=content)}
        if found.rid is not None and self.engine is not None:
            overrides["model_settings"] = with_engine_fields(
                request.model_settings, found.rid, self.engine
            )
        return request.override(**overrides)
