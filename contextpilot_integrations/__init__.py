"""contextpilot-integrations: reuse context across LLM requests.

Aligns, schedules, de-duplicates and annotates retrieved context blocks against one shared
context index that mirrors the engine's KV prefix cache (ContextPilot, MLSys 2026).
"""

from importlib.metadata import PackageNotFoundError, version

from contextpilot_integrations.core import (
    DEFAULT_SYSTEM_PROMPT,
    ApproxTokenCounter,
    BatchPlan,
    ContextIndex,
    ContextPilot,
    OrderingConfig,
    Placement,
    PlacementStatus,
    Plan,
    Planner,
    PlanningWindow,
    PlanRequest,
    PromptLayout,
    ReplicaRouter,
    RidConflictError,
    Scope,
    TokenCounter,
    TokenizerCounter,
    TurnVisibility,
    block_id,
)

try:
    __version__ = version("contextpilot-integrations")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ApproxTokenCounter",
    "BatchPlan",
    "ContextIndex",
    "ContextPilot",
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
    "TokenCounter",
    "TokenizerCounter",
    "TurnVisibility",
    "__version__",
    "block_id",
]
