"""Framework-free core: block identity, the context index, alignment, scheduling, de-duplication,
rendering, the request and plan types, the ``ContextPilot`` facade (its ``OrderingConfig``, the
``EngineLinkProtocol`` it follows the engine through) and the ``ReplicaRouter`` over several
engine replicas."""

from contextpilot_integrations.core.blocks import (
    ApproxTokenCounter,
    ContextBlock,
    TokenCounter,
    TokenizerCounter,
    block_id,
)
from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.engine_link_protocol import EngineLinkProtocol
from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.core.index.index_types import IndexStats, SearchResult
from contextpilot_integrations.core.ordering.ordering_config import OrderingConfig
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import (
    BatchPlan,
    DedupFigures,
    Placement,
    PlacementStatus,
    Plan,
)
from contextpilot_integrations.core.planner_protocol import Planner
from contextpilot_integrations.core.rendering import DEFAULT_SYSTEM_PROMPT, PromptLayout
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import PlanRequest, RidConflictError, Scope
from contextpilot_integrations.core.window.planning_window import PlanningWindow

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ApproxTokenCounter",
    "BatchPlan",
    "ContextBlock",
    "ContextIndex",
    "ContextPilot",
    "DedupFigures",
    "EngineLinkProtocol",
    "IndexStats",
    "OrderingConfig",
    "Placement",
    "PlacementStatus",
    "Plan",
    "PlanRequest",
    "Planner",
    "PlanningWindow",
    "PromptLayout",
    "ReplicaRouter",
    "RidConflictError",
    "Scope",
    "SearchResult",
    "TokenCounter",
    "TokenizerCounter",
    "TurnVisibility",
    "block_id",
]
