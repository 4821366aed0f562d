"""A LangChain agent middleware that gives each user turn its Mem0 memories, once.

For ``langchain.agents.create_agent`` (langchain 1.x). At the first model call of a user turn
(``wrap_model_call`` / ``awrap_model_call`` when the request's last message is a user message
that carries no memories yet) the middleware searches the memory with that message and sends
the model, in this order (docs/DESIGN.md, "Prompt layout"):

1. the agent's own system message, unchanged;
2. the conversation's earlier messages, unchanged;
3. the user message, its content after the memory context (memory system prompt, the memories
   as labelled documents, location hints, order annotation): ``[memory context][question]``.

The user message with its memories goes into the agent's state (replacing the message of the
same id), so every later call of the conversation, in this turn's tool loop and in the next
turns, sends it byte-identical and searches nothing (docs/DESIGN.md, "Mem0"). Why there and not
in the system message: an engine's prefix cache reuses a call's KV only up to the first changed
byte, and the system message comes first; memories rebuilt into it change it whenever the
search does (every user turn), so the whole history behind it is prefilled again. A memory
context that never changes once sent, placed where the conversation grows, keeps every call's
prompt a prefix of the next one's: the memories cost their own tokens, once per turn. The
message's ``additional_kwargs["contextpilot_memory_chars"]`` (:data:`MEMORY_CHARS_KEY`) is the
memory context's length in characters (the start of a string content, the first block of a
list content), so an application can show the user's own text.

Each turn's memory context is complete: memories an earlier turn showed are shown again. A
message written once cannot know which earlier messages later calls still send (a trimming or
summarising middleware may drop them), so a hint into them could point at nothing
(docs/DESIGN.md, "Lossless").

With a :class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory` the memories are
aligned against the shared index, so conversations of one user that start with the same
system prompt share the memories the index placed first; with a plain ``mem0.Memory`` they come
in Mem0's order. Changing one line, ``memory = ContextPilotMemory(memory)``, switches between
the two.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, get_args

from langchain.agents.middleware import (
    AgentMiddleware,
    ExtendedModelResponse,
    ModelRequest,
    ModelResponse,
)
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.types import Command

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.llm_call.engine_fields import EngineKind, with_engine_fields
from contextpilot_integrations.mem0.context import (
    MemoryContext,
    asearch_memory_context,
    search_memory_context,
)
from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT
from contextpilot_integrations.mem0.scope import ENTITY_KEYS

__all__ = ["MEMORY_CHARS_KEY", "Mem0MemoryMiddleware"]

Filters = Mapping[str, Any] | Callable[[ModelRequest], Mapping[str, Any]]

MEMORY_CHARS_KEY = "contextpilot_memory_chars"
"""The ``additional_kwargs`` key of a user message that carries its turn's memory context; the
value is the context's length in characters."""


def _new_turn(messages: Sequence[AnyMessage]) -> HumanMessage | None:
    """The user message that opens a turn without memories yet: the request's last message
    when it is a user message with text and no memory context; else ``None`` (a call of a
    turn's tool loop, or a turn that has its memories)."""
    last = messages[-1] if messages else None
    if not isinstance(last, HumanMessage) or MEMORY_CHARS_KEY in last.additional_kwargs:
        return None
    return last if last.text.strip() else None


def _with_context(message: HumanMessage, context: str) -> HumanMessage:
    """``message`` (same id) with ``context`` in front of its content and the marker set."""
    content: str | list[str | dict[str, Any]]
    if isinstance(message.content, str):
        content = context + message.content
    else:
        content = [{"type": "text", "text": context}, *message.content]
    marked = {**message.additional_kwargs, MEMORY_CHARS_KEY: len(context)}
    return message.model_copy(update={"content": content, "additional_kwargs": marked})


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
    """Puts Mem0 memories in front of the user message that opens each turn, once per turn.

    The turn's first model call searches the memory with the user message; the message with
    the memory context in front (marked with :data:`MEMORY_CHARS_KEY`) replaces it in the
    agent's state, so later calls send it unchanged. The system message is never changed.

    Args:
        memory: a :class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory` /
            :class:`~contextpilot_integrations.mem0.memory.AsyncContextPilotMemory`, or a plain
            ``mem0.Memory`` / ``mem0.AsyncMemory``. A synchronous memory serves both ``invoke``
            and ``ainvoke`` (the latter in a worker thread); an asynchronous one only
            ``ainvoke``.
        filters: the Mem0 scope: a dict (``{"user_id": "alice"}``) or a function of the
            ``ModelRequest`` (of the turn's first call); default: ``user_id`` / ``agent_id`` /
            ``run_id`` read from the runtime context
            (``agent.invoke(..., context={"user_id": "alice"})``).
        top_k: memories per search.
        search_kwargs: other arguments for Mem0's ``search`` (``threshold``, ``rerank``, ...).
        layout: the layout for a plain memory (a wrapped one uses its pilot's).
        engine: send the plan's rid to this engine when the memory is wrapped: its body
            fields (:func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields`;
            ``"any"``: SGLang's and vLLM's) are merged into the ``model_settings["extra_body"]``
            of the turn's first call, the request the plan was made for (for
            ``langchain_openai.ChatOpenAI`` on an OpenAI-compatible server), so the engine's
            cache events name the plan's request; the tool loop's calls carry none.
            ``None`` (default): model settings unchanged (a model that takes no
            ``extra_body``).

    Raises:
        TypeError: ``memory`` has no ``search``; ``filters`` neither a dict nor a function.
        ValueError: ``top_k < 1``; an unknown ``engine``.
        At a turn's first model call: ValueError, no scope (no ``filters`` and none in the
        runtime context); whatever Mem0's ``search`` raises.
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
    ) -> ModelResponse | AIMessage | ExtendedModelResponse:
        """At a turn's first call, search the memory with the user message and call the model
        with the memory context in front of it, writing that message to the state; any other
        call, or a search that finds no memory, goes to the model unchanged."""
        opening = _new_turn(request.messages)
        if opening is None:
            return handler(request)
        found = search_memory_context(
            self.memory,
            opening.text,
            self._scope(request),
            layout=self.layout,
            **self._search_args(),
        )
        if not found.text:
            return handler(request)
        message = _with_context(opening, found.text)
        return self._answer(handler(self._with_memories(request, message, found)), message)

    async def awrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse | AIMessage | ExtendedModelResponse:
        """Async :meth:`wrap_model_call`."""
        opening = _new_turn(request.messages)
        if opening is None:
            return await handler(request)
        found = await asearch_memory_context(
            self.memory,
            opening.text,
            self._scope(request),
            layout=self.layout,
            **self._search_args(),
        )
        if not found.text:
            return await handler(request)
        message = _with_context(opening, found.text)
        return self._answer(await handler(self._with_memories(request, message, found)), message)

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

    def _with_memories(
        self, request: ModelRequest, message: HumanMessage, found: MemoryContext
    ) -> ModelRequest:
        overrides: dict[str, Any] = {"messages": [*request.messages[:-1], message]}
        if found.rid is not None and self.engine is not None:
            overrides["model_settings"] = with_engine_fields(
                request.model_settings, found.rid, self.engine
            )
        return request.override(**overrides)

    @staticmethod
    def _answer(
        response: ModelResponse | AIMessage, message: HumanMessage
    ) -> ModelResponse | AIMessage | ExtendedModelResponse:
        """The model's answer, with the state update that replaces the user message by the one
        carrying its memories (``add_messages`` replaces a message of the same id in place). A
        message without an id (made by another middleware, not from the state) has nothing to
        replace: only this call sees the memories."""
        if message.id is None:
            return response
        if isinstance(response, AIMessage):
            response = ModelResponse(result=[response])
        return ExtendedModelResponse(
            model_response=response, command=Command(update={"messages": [message]})
        )
