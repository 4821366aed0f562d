"""Prompt templates that render a ContextPilot plan in the prompt layout.

``[system prompt][block 1]...[block n][location hints][order annotation][question]``
(docs/DESIGN.md, "Prompt layout"), rendered by the core's
:class:`~contextpilot_integrations.core.rendering.PromptLayout`; nothing request-specific comes
before or inside the blocks.

- :func:`text_qa_template` for query engines and response synthesizers
  (``as_query_engine(text_qa_template=...)``, ``get_response_synthesizer(...)``): a completion
  model gets exactly ``plan.prompt``, a chat model exactly ``plan.messages``.
- :func:`chat_context_template` for ``condense_plus_context`` (and ``context``) chat engines:
  the system message holds the system prompt, the context and the annotation; the engine adds
  the chat history and the user's message after it.

A template finds its plan in the post-processor's :class:`~.plan_store.PlanStore` by the
``context_str`` LlamaIndex formats it with; when none matches (``refine`` mode, a context split
into chunks, nodes changed by a later post-processor) it renders ``context_str`` as given,
after the system prompt, and logs it once per template. In a conversation the context is the
kept sections of the earlier turns (:mod:`.conversation_sections`), then this turn's, each
after the layout's turn header (:meth:`PromptLayout.render_turns
<contextpilot_integrations.core.rendering.PromptLayout.render_turns>`), then
``plan.context_tail``; the template records the section it rendered for the next turn.
Rendering a plan arms its request id (:mod:`.request_ids`) for the LLM call that follows.
"""

from __future__ import annotations

import logging
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate, SelectorPromptTemplate
from llama_index.core.prompts.prompt_type import PromptType
from llama_index.core.prompts.utils import is_chat_model

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.llama_index.conversation_sections import ConversationSections
from contextpilot_integrations.llama_index.plan_store import PlanStore, StoredPlan
from contextpilot_integrations.llama_index.postprocessor import ContextPilotNodePostprocessor
from contextpilot_integrations.llama_index.request_ids import arm_plan

__all__ = ["PlanRenderer", "chat_context_template", "text_qa_template"]

logger = logging.getLogger(__name__)


class PlanRenderer:
    """Renders the plan behind a ``context_str`` (the callables the templates map variables to).

    Args:
        plans: the post-processor's plan store.
        sections: the post-processor's conversation sections (read and recorded).
        layout: the layout used when no plan matches (a found plan renders with its own).
    """

    def __init__(
        self, plans: PlanStore, sections: ConversationSections, layout: PromptLayout
    ) -> None:
        self.plans = plans
        self.sections = sections
        self.layout = layout
        self._warned = False

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanRenderer:
        # LlamaIndex deep-copies templates (``partial_format``); every copy must read the
        # same stores, so the renderer is shared, never copied.
        return self

    # --- the template variables ---------------------------------------------------------------
    def system(self, **kwargs: Any) -> str:
        """The chat form's system message: the layout's system prompt."""
        stored = self._find(kwargs.get("context_str"), arm=False)
        return (stored.plan.layout if stored else self.layout).system_prompt

    def prompt_context(self, **kwargs: Any) -> str:
        """Completion form: system prompt line, context, hints, annotation."""
        stored = self._find(kwargs.get("context_str"))
        layout = stored.plan.layout if stored else self.layout
        return layout.system_segment() + self._context(stored, kwargs.get("context_str"))

    def message_context(self, **kwargs: Any) -> str:
        """Chat form's user message start: context, hints, annotation."""
        return self._context(self._find(kwargs.get("context_str")), kwargs.get("context_str"))

    def question(self, **kwargs: Any) -> str:
        """The question line, after the context."""
        stored = self._find(kwargs.get("context_str"), arm=False)
        layout = stored.plan.layout if stored else self.layout
        return layout.question_template.format(question=kwargs.get("query_str") or "")

    # --- rendering ----------------------------------------------------------------------------
    def render_context(self, stored: StoredPlan) -> str:
        """Blocks (in a conversation: earlier sections, then this turn's), hints, annotation.

        Records this turn's section in its conversation (see the module docstring).
        """
        plan = stored.plan
        conversation, turn = plan.scope.conversation, plan.scope.turn
        if conversation is None:
            return plan.context  # the question comes from the template
        turns: list[tuple[int, tuple[str, ...]]] = [
            (earlier, (text,)) for earlier, text in stored.earlier_sections
        ]
        own = plan.segments[1:-1]
        if own and turn is not None:  # no own section when every block is replaced by a hint
            turns.append((turn, own))
            self.sections.record(*conversation, turn, "".join(own), plan.prompt_tokens)
        segments, _ = plan.layout.render_turns(turns)
        if turn is None:  # a planner that numbered no turn: shown, never pointed to later
            segments.extend(own)
        return "".join(segments) + plan.context_tail

    def _context(self, stored: StoredPlan | None, context_str: object) -> str:
        if stored is not None:
            return self.render_context(stored)
        text = str(context_str or "").strip()
        return f"{text}\n" if text else ""

    def _find(self, context_str: object, *, arm: bool = True) -> StoredPlan | None:
        text = str(context_str or "")
        if not text.strip():
            return None  # LlamaIndex sizing the empty template
        stored = self.plans.find(text)
        if stored is None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "no ContextPilot plan matches the context given to the prompt template "
                    "(%d characters); rendering it without labels and annotation. Usual causes: "
                    "the context was split into several chunks (refine mode, or longer than the "
                    "LLM context window), or a node post-processor after ContextPilot changed "
                    "the nodes.",
                    len(text),
                )
            return None
        if arm:
            arm_plan(stored.plan)
        return stored


def text_qa_template(postprocessor: ContextPilotNodePostprocessor) -> SelectorPromptTemplate:
    """The question-answering template for query engines and response synthesizers.

    Completion models get ``plan.prompt``; chat models (``llm.metadata.is_chat_model``) get
    ``plan.messages``. Both are byte-identical over the blocks of requests that share them.

    Args:
        postprocessor: the post-processor whose plans it renders (any sibling from
            ``for_conversation`` shares the stores).

    Raises:
        TypeError: ``postprocessor`` is not a :class:`ContextPilotNodePostprocessor`.
    """
    renderer = _renderer(postprocessor)
    completion = PromptTemplate(
        "{context_str}{query_str}",
        prompt_type=PromptType.QUESTION_ANSWER,
        function_mappings={"context_str": renderer.prompt_context, "query_str": renderer.question},
    )
    messages = [ChatMessage(role=MessageRole.USER, content="{context_str}{query_str}")]
    mappings = {"context_str": renderer.message_context, "query_str": renderer.question}
    if renderer.layout.system_prompt:
        messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content="{contextpilot_system}"))
        mappings["contextpilot_system"] = renderer.system
    chat = ChatPromptTemplate(
        message_templates=messages,
        prompt_type=PromptType.QUESTION_ANSWER,
        function_mappings=mappings,
    )
    return SelectorPromptTemplate(default_template=completion, conditionals=[(is_chat_model, chat)])


def chat_context_template(postprocessor: ContextPilotNodePostprocessor) -> PromptTemplate:
    """The context (system message) template for ``condense_plus_context``/``context`` chat
    engines: system prompt, context (earlier turns' sections first), hints, annotation. Pass it
    as ``context_prompt`` (``condense_plus_context``) or ``context_template`` (``context``);
    the engine appends its own ``system_prompt`` after it. The turn header is the pilot's
    ``PromptLayout.turn_header``.

    Raises:
        TypeError: ``postprocessor`` is not a :class:`ContextPilotNodePostprocessor`.
    """
    renderer = _renderer(postprocessor)
    return PromptTemplate(
        "{context_str}",
        prompt_type=PromptType.CONVERSATION,
        function_mappings={"context_str": renderer.prompt_context},
    )


def _renderer(postprocessor: object) -> PlanRenderer:
    if not isinstance(postprocessor, ContextPilotNodePostprocessor):
        raise TypeError(
            f"postprocessor must be a ContextPilotNodePostprocessor, got "
            f"{type(postprocessor).__name__}"
        )
    return PlanRenderer(postprocessor.plans, postprocessor.sections, postprocessor.layout)
