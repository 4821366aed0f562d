"""Planning over chat messages: byte-stable history and pointers for repeated tool output
(the rules are in :mod:`.message_planner`)."""

from contextpilot_integrations.core.messages.message_plan import (
    MessagePlan,
    ResultPlacement,
    ResultStatus,
)
from contextpilot_integrations.core.messages.message_planner import MessagePlanner

__all__ = ["MessagePlan", "MessagePlanner", "ResultPlacement", "ResultStatus"]
