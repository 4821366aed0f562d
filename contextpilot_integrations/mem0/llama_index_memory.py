"""A LlamaIndex memory block that puts Mem0 memories in front of the chat history.

For ``llama_index.core.memory.Memory`` (llama-index-core 0.14), the memory that chat engines
(``SimpleChatEngine``, ``CondensePlusContextChatEngine``) and agents (``FunctionAgent``,
``ReActAgent``) read before each LLM call. ``Memory.get`` asks each memory block for its
content; a block that returns chat messages has them placed before the chat history. This
block returns one system message: the memory context (memory system prompt, the memories as
labelled documents, location hints, order annotation) for the latest user message, so the
prompt reads ``[prefix messages][memory context][chat history]`` (docs/DESIGN.md, "Prompt layout").

Messages that ``Memory`` flushes out of its short-term history (its waterfall to long-term
blocks) are added to Mem0 in the block's scope, like LlamaIndex's own fact-extraction and
vector memory blocks.

With a :class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory` the memories are
aligned against the shared index; with a plain ``mem0.Memory`` they come in Mem0's order.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.bridge.pydantic import Field, field_validator
from llama_index.core.memory.memory import BaseMemoryBlock

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.mem0.context import asearch_memory_context
from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT
from contextpilot_integrations.mem0.scope import ENTITY_KEYS

__all__ = ["Mem0MemoryBlock"]


def _latest_user_text(messages: list[ChatMessage] | None) -> str | None:
    for message in reversed(messages or []):
        if message.role == MessageRole.USER:
            text = message.content or ""
            return text if text.strip() else None
    return None


class Mem0MemoryBlock(BaseMemoryBlock[list[ChatMessage]]):
    """Mem0 memories as a LlamaIndex memory block.

    Attributes:
        memory: a ``ContextPilotMemory`` / ``AsyncContextPilotMemory`` or a plain
            ``mem0.Memory`` / ``mem0.AsyncMemory`` (a synchronous one runs in a worker thread).
        filters: the Mem0 scope, at least one of ``user_id``, ``agent_id``, ``run_id``.
        top_k: memories per search.
        search_kwargs: other arguments for Mem0's ``search``.
        infer: ``infer`` for Mem0's ``add`` of flushed messages (Mem0's default ``True``
            extracts facts with Mem0's LLM; ``False`` stores each message's text).
        layout: the layout for a plain memory (a wrapped one uses its pilot's).
        last_rid: the request id of the latest plan (``None`` for a plain memory or before
            the first search): send it with the LLM call.

    Raises:
        ValueError: on construction, ``filters`` without an entity id.
    """

    name: str = Field(default="mem0_memories", description="The memory block's name.")
    memory: Any = Field(description="The Mem0 memory, wrapped or plain.", exclude=True)
    filters: dict[str, Any] = Field(description="Mem0 scope: user_id / agent_id / run_id.")
    top_k: int = Field(default=20, ge=1, description="Memories per search.")
    search_kwargs: dict[str, Any] = Field(default_factory=dict)
    infer: bool = Field(default=True, description="infer for Mem0's add of flushed messages.")
    layout: PromptLayout = Field(default=MEMORY_LAYOUT, exclude=True)
    last_rid: str | None = Field(default=None, description="Request id of the latest plan.")

    @field_validator("filters")
    @classmethod
    def _has_scope(cls, filters: dict[str, Any]) -> dict[str, Any]:
        if not any(filters.get(key) is not None for key in ENTITY_KEYS):
            raise ValueError(f"filters must name one of {', '.join(ENTITY_KEYS)}, got {filters!r}")
        return filters

    async def _aget(
        self, messages: list[ChatMessage] | None = None, **block_kwargs: Any
    ) -> list[ChatMessage]:
        """One system message with the memory context for the latest user message (none
        when there is no user message or no memory)."""
        query = _latest_user_text(messages)
        if query is None:
            return []
        found = await asearch_memory_context(
            self.memory,
            query,
            self.filters,
            layout=self.layout,
            **{**self.search_kwargs, "top_k": self.top_k},
        )
        self.last_rid = found.rid
        if not found.text:
            return []
        return [ChatMessage(role=MessageRole.SYSTEM, content=found.text)]

    async def _aput(self, messages: list[ChatMessage]) -> None:
        """Add the user and assistant messages' text to Mem0 in this block's scope."""
        entries = [
            {"role": m.role.value, "content": m.content}
            for m in messages
            if m.role in (MessageRole.USER, MessageRole.ASSISTANT) and (m.content or "").strip()
        ]
        if not entries:
            return
        scope = {k: self.filters[k] for k in ENTITY_KEYS if self.filters.get(k) is not None}
        if inspect.iscoroutinefunction(self.memory.add):
            await self.memory.add(entries, infer=self.infer, **scope)
        else:
            await asyncio.to_thread(self.memory.add, entries, infer=self.infer, **scope)
