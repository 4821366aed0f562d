"""Mem0 adapter: aligned, de-duplicated memories in front of an agent.

- :class:`ContextPilotMemory` / :class:`AsyncContextPilotMemory` wrap ``mem0.Memory`` /
  ``mem0.AsyncMemory`` (and the platform ``MemoryClient`` / ``AsyncMemoryClient``): ``search``
  keeps Mem0's signature and the client's answer shape (a dict with ``"results"``, other keys
  such as ``"relations"`` unchanged, or a bare list), with at most ``top_k`` results in prompt
  order, each with ``result["contextpilot"]``
  (:mod:`contextpilot_integrations.core.placement_metadata`; :mod:`.memory`, planned by
  :mod:`.search_results`).
- :func:`scope_from_filters`: Mem0 filters (``user_id``, ``agent_id``, ``run_id``) and a
  conversation id as the core's :class:`~contextpilot_integrations.core.request.Scope`.
- Agent hooks (imported from their modules, each needs its framework):
  :class:`~.langchain_middleware.Mem0MemoryMiddleware` (LangChain ``create_agent``) and
  :class:`~.llama_index_memory.Mem0MemoryBlock` (LlamaIndex ``Memory``).
- :func:`~.local_config.local_mem0_config`: Mem0 on local Qdrant and MiniLM, no network.
"""

from contextpilot_integrations.mem0.layout import MEMORY_LAYOUT, memory_context
from contextpilot_integrations.mem0.memory import AsyncContextPilotMemory, ContextPilotMemory
from contextpilot_integrations.mem0.scope import scope_from_filters
from contextpilot_integrations.mem0.search_results import (
    MemorySearch,
    aplan_search_results,
    plan_search_results,
)

__all__ = [
    "MEMORY_LAYOUT",
    "AsyncContextPilotMemory",
    "ContextPilotMemory",
    "MemorySearch",
    "aplan_search_results",
    "memory_context",
    "plan_search_results",
    "scope_from_filters",
]
