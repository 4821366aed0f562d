"""Framework-free core: block identity, the context index, alignment, scheduling, rendering."""

from .blocks import ApproxTokenCounter, ContextBlock, TokenCounter, TokenizerCounter, block_id
from .context_index import ContextIndex, IndexStats, SearchResult
from .pilot import BatchPlan, ContextPilot, Plan, PlannedBlock
from .rendering import DEFAULT_SYSTEM_PROMPT, PromptLayout

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ApproxTokenCounter",
    "BatchPlan",
    "ContextBlock",
    "ContextIndex",
    "ContextPilot",
    "IndexStats",
    "Plan",
    "PlannedBlock",
    "PromptLayout",
    "SearchResult",
    "TokenCounter",
    "TokenizerCounter",
    "block_id",
]
