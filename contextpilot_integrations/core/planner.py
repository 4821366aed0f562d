"""The interface every adapter plans through.

Satisfied by the in-process :class:`~contextpilot_integrations.core.pilot.ContextPilot` and by
the index service's client (:class:`~contextpilot_integrations.service.client.ContextPilotClient`),
so the LangChain, LlamaIndex and Mem0 adapters take either: one shared context index per
process, or one per fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .conversation import TurnVisibility
    from .pilot import BatchPlan, Plan

__all__ = ["Planner"]


@runtime_checkable
class Planner(Protocol):
    """Plans requests against a context index (see ``ContextPilot.plan`` / ``plan_batch``)."""

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        conversation_id: str | None = None,
        tenant: str = "",
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Plan: ...

    def plan_batch(
        self,
        queries: Sequence[str],
        blocks: Sequence[Sequence[str]],
        *,
        rids: Sequence[str] | None = None,
        conversation_ids: Sequence[str | None] | None = None,
        tenants: Sequence[str] | None = None,
        turns: Sequence[int | None] | None = None,
        visibilities: Sequence[TurnVisibility | None] | None = None,
    ) -> BatchPlan: ...

    def evict(self, rid: str) -> bool: ...
