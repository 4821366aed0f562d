"""Search a Mem0 memory and render the memory context for one model call (the agent hooks'
shared step).

Works with a wrapped memory (:class:`~.memory.ContextPilotMemory`,
:class:`~.memory.AsyncContextPilotMemory`: aligned, de-duplicated, annotated) and with a plain
``mem0.Memory`` / ``mem0.AsyncMemory`` or platform ``MemoryClient`` / ``AsyncMemoryClient``
(memories in Mem0's order, the same layout): wrapping the memory is the one line an application
changes. Either way at most ``top_k`` memories are used, whatever the client returns.

Searches made here use ``TurnVisibility.last(0)``, so no memory is ever replaced by a hint
pointing at an earlier turn: each memory context is complete on its own. The LlamaIndex block
renders its context again for every model call, replacing the previous one, so an earlier
call's memories are not in the next prompt; the LangChain middleware's context stays in the
conversation, but a later call may leave out the earlier turn a hint would point into (a
trimming or summarising middleware drops it).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import is_block_text
from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT, plain_memory_context
from contextpilot_integrations.mem0.memory import (
    MEM0_DEFAULT_TOP_K,
    AsyncContextPilotMemory,
    ContextPilotMemory,
)
from contextpilot_integrations.mem0.search_results import MemorySearch, top_results

__all__ = ["MemoryContext", "asearch_memory_context", "search_memory_context"]

_NOT_KEPT_IN_PROMPT = TurnVisibility.last(0)


@dataclass(frozen=True)
class MemoryContext:
    """The memories for one model call.

    Attributes:
        text: the memory context (system prompt, memories, hints, annotation); ``""`` when
            the search found no memory with text.
        rid: the plan's request id (send it with the model call); ``None`` for a plain memory.
        results: the search results (for a wrapped memory in output order, each with its
            ``"contextpilot"`` entry).
    """

    text: str
    rid: str | None
    results: list[dict[str, Any]]


def _plain(response: Any, search_kwargs: Mapping[str, Any], layout: PromptLayout) -> MemoryContext:
    # At most top_k memories, as a wrapped memory gives, even when the client returns more.
    results = top_results(response, search_kwargs.get("top_k", MEM0_DEFAULT_TOP_K))
    texts = [
        r["memory"]
        for r in results
        if isinstance(r, Mapping)
        and isinstance(r.get("memory"), str)
        and is_block_text(r["memory"])
    ]
    return MemoryContext(plain_memory_context(texts, layout) if texts else "", None, results)


def _planned(found: MemorySearch) -> MemoryContext:
    text = found.context if found.plan.blocks or found.plan.hints else ""
    return MemoryContext(text, found.plan.rid, found.results)


def search_memory_context(
    memory: Any,
    query: str,
    filters: Mapping[str, Any],
    *,
    layout: PromptLayout = MEMORY_LAYOUT,
    **search_kwargs: Any,
) -> MemoryContext:
    """Search a synchronous memory and render the memory context.

    Args:
        memory: a :class:`~.memory.ContextPilotMemory` or a plain ``mem0.Memory``.
        query: the search query (the latest user message).
        filters: Mem0 filters (the scope).
        layout: the layout for a plain memory (a wrapped one renders with its pilot's).
        search_kwargs: passed to Mem0's ``search`` (``top_k``, ``threshold``, ...); at most
            ``top_k`` results (default Mem0's, 20) are used, wrapped or plain, the first of the
            memory's answer when it returns more.

    Returns:
        The :class:`MemoryContext`; its ``results`` is a list whatever shape the memory's
        answer has (a dict with ``"results"`` or a bare list).

    Raises:
        TypeError: ``memory`` is asynchronous (use :func:`asearch_memory_context`); an answer
            of no Mem0 shape (:func:`~.memory.top_results`).
        Whatever the memory's ``search`` raises.
    """
    if isinstance(memory, AsyncContextPilotMemory) or inspect.iscoroutinefunction(
        getattr(memory, "search", None)
    ):
        raise TypeError(
            f"{type(memory).__name__} is asynchronous: use asearch_memory_context (or the "
            "agent's async API)"
        )
    if isinstance(memory, ContextPilotMemory):
        found = memory.search_with_plan(
            query, filters=dict(filters), visibility=_NOT_KEPT_IN_PROMPT, **search_kwargs
        )
        return _planned(found)
    response = memory.search(query, filters=dict(filters), **search_kwargs)
    return _plain(response, search_kwargs, layout)


async def asearch_memory_context(
    memory: Any,
    query: str,
    filters: Mapping[str, Any],
    *,
    layout: PromptLayout = MEMORY_LAYOUT,
    **search_kwargs: Any,
) -> MemoryContext:
    """:func:`search_memory_context` for an async caller: awaits an asynchronous memory
    (:class:`~.memory.AsyncContextPilotMemory`, ``mem0.AsyncMemory``) and runs a synchronous
    one in a worker thread."""
    if isinstance(memory, AsyncContextPilotMemory):
        found = await memory.search_with_plan(
            query, filters=dict(filters), visibility=_NOT_KEPT_IN_PROMPT, **search_kwargs
        )
        return _planned(found)
    if inspect.iscoroutinefunction(getattr(memory, "search", None)):
        response = await memory.search(query, filters=dict(filters), **search_kwargs)
        return _plain(response, search_kwargs, layout)
    return await asyncio.to_thread(
        search_memory_context, memory, query, filters, layout=layout, **search_kwargs
    )
