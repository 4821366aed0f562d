"""The prompt layout for memories, and the memory context put in front of a conversation.

Memories are context blocks like retrieved documents (a memory's text is the block text), so
they follow the prompt layout (docs/DESIGN.md, "Prompt layout"): ``[system prompt][memory 1]
...[memory n][location hints][order annotation]``. For an agent the question is not part of
it: the LangChain middleware puts the memory context in front of the text of the user message
that opens a turn (the question), the LlamaIndex block in front of the chat history.
"""

from __future__ import annotations

from collections.abc import Sequence

from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.rendering import PromptLayout

__all__ = ["MEMORY_LAYOUT", "memory_context", "plain_memory_context"]

MEMORY_LAYOUT = PromptLayout(
    system_prompt=(
        "Memories about the user from earlier conversations are listed below, each under a "
        "label such as [Memory 1]. Use the ones that are relevant to the conversation."
    ),
    label_template="[Memory {position}]",
    annotation_template="Most relevant memories first: {order}.\n",
)
"""The default layout of :class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory`'s
pilot: memories labelled ``[Memory i]`` by prompt position."""


def memory_context(plan: Plan) -> str:
    """The plan's prompt without the question: system prompt, then ``plan.context``
    (memories, hints, annotation).

    The system prompt and the memories are byte-identical to the plan's segments, so the
    text starts with the prefix the context index expects the engine to have cached.
    """
    return plan.segments[0] + plan.context


def plain_memory_context(texts: Sequence[str], layout: PromptLayout = MEMORY_LAYOUT) -> str:
    """Memories rendered as they come (no alignment, no annotation): what a plain Mem0 memory
    gets, the baseline a :class:`~contextpilot_integrations.mem0.memory.ContextPilotMemory`
    improves on.

    Args:
        texts: memory texts in Mem0's order.
        layout: the layout.
    """
    return "".join(layout.render_segments(texts, "")[:-1])
