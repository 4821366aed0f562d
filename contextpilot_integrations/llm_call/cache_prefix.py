"""What a hosted prompt cache needs to know of one plan: its rendered blocks, shared prefix,
block ids, conversation and tenant salt.

Anthropic's breakpoints (:mod:`~contextpilot_integrations.llm_call.anthropic_breakpoints`) and
OpenAI's cache key (:mod:`~contextpilot_integrations.llm_call.openai_cache_key`) are both placed
from it.

Public API: :class:`CachePrefix`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contextpilot_integrations.core.plan import Plan

__all__ = ["CachePrefix"]


@dataclass(frozen=True)
class CachePrefix:
    """What breakpoint placement and cache keys need to know of one plan.

    Attributes:
        blocks: the rendered blocks in prompt order, exactly as sent (``plan.segments[1:-1]``).
        shared_blocks: the leading blocks another indexed request also starts with
            (``Plan.shared_prefix_blocks``).
        block_ids: the shown blocks' ids in prompt order (for :func:`prompt_cache_key`).
        conversation: whether the request is a turn of a conversation.
        salt: the tenant's ``cache_salt`` (keys of different tenants differ), or ``None``.
    """

    blocks: tuple[str, ...]
    shared_blocks: int = 0
    block_ids: tuple[int, ...] = ()
    conversation: bool = False
    salt: str | None = None

    @classmethod
    def of(cls, plan: Plan) -> CachePrefix:
        """From a :class:`~contextpilot_integrations.core.plan.Plan`."""
        return cls(
            tuple(plan.segments[1:-1]),
            plan.shared_prefix_blocks,
            tuple(p.block_id or 0 for p in plan.blocks),
            plan.scope.conversation_id is not None,
            plan.cache_salt,
        )
