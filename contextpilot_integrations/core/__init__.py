"""Framework-free core: block identity, the context index, alignment, scheduling, de-duplication,
rendering, the request and plan types, the ``ContextPilot`` facade and the ``ReplicaRouter`` over
several engine replicas."""

from .blocks import ApproxTokenCounter, ContextBlock, TokenCounter, TokenizerCounter, block_id
from .context_index import ContextIndex, IndexStats, SearchResult
from .conversation import TurnVisibility
from .pilot import ContextPilot
from .plan import BatchPlan, DedupFigures, Placement, PlacementStatus, Plan
from .planner_protocol import Planner
from .planning_window import PlanningWindow
from .rendering import DEFAULT_SYSTEM_PROMPT, PromptLayout
from .request import PlanRequest, RidConflictError, Scope
from .routing import ReplicaRouter

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ApproxTokenCounter",
    "BatchPlan",
    "ContextBlock",
    "ContextIndex",
    "ContextPilot",
    "DedupFigures",
    "IndexStats",
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
