"""Mem0 adapter: aligned, de-duplicated memories in front of an agent.

- :class:`ContextPilotMemory` / :class:`AsyncContextPilotMemory` wrap ``mem0.Memory`` /
  ``mem0.AsyncMemory``: ``search`` keeps Mem0's signature and answer shape, with the results in
  prompt order and marked (:mod:`.memory`).
- Agent hooks (imported from their modules, each needs its framework):
  :class:`~.langchain_middleware.Mem0MemoryMiddleware` (LangChain ``create_agent``) and
  :class:`~.llama_index_memory.Mem0MemoryBlock` (LlamaIndex ``Memory``).
- :func:`~.local_config.local_mem0_config`: Mem0 on local Qdrant and MiniLM, no network.
"""

from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT, memory_context
from contextpilot_integrations.mem0.memory import (
    MARK_KEY,
    MARK_KEYS,
    AsyncContextPilotMemory,
    ContextPilotMemory,
    MemorySearch,
    plan_search_results,
)
from contextpilot_integrations.mem0.scope import MemoryScope, memory_scope

__all__ = [
    "MARK_KEY",
    "MARK_KEYS",
    "MEMORY_LAYOUT",
    "AsyncContextPilotMemory",
    "ContextPilotMemory",
    "MemoryScope",
    "MemorySearch",
    "memory_context",
    "memory_scope",
    "plan_search_results",
]
