"""Prompt formatting: the documents first, then hints and the order annotation, then the question.

The usual LCEL RAG chain works with one import changed::

    from contextpilot_integrations.langchain import (
        CONTEXTPILOT_PROMPT, ContextPilotRetriever, format_documents, with_plan_fields,
    )

    retriever = ContextPilotRetriever(base_retriever=vectorstore.as_retriever())
    chain = (
        {"context": retriever | format_documents, "question": RunnablePassthrough()}
        | CONTEXTPILOT_PROMPT
        | with_plan_fields(ChatOpenAI(base_url=..., model=...))
    )

:data:`format_documents` renders the documents :class:`~.retriever.ContextPilotRetriever`
returned with the core renderer (:class:`~contextpilot_integrations.PromptLayout`, one function
for every adapter, so that the index, the renderer and the engine agree): block ``i`` is
``layout.render_block(i, page_content)``, and after the blocks comes the plan's context tail
(location hints and order annotation, docs/DESIGN.md, "Prompt layout"). Its output is a
:class:`RenderedContext`, a ``str`` that also carries the plan's fields (``rid``, schedule
position, cache prefix, prompt cache key). :data:`CONTEXTPILOT_PROMPT` puts that string in the
user message, before the question, and returns a :class:`ContextPilotPromptValue`, a
``ChatPromptValue`` that keeps those fields for :func:`~.plan_fields.with_plan_fields`. The
messages equal ``Plan.messages``: the system prompt, then one user message
``"".join(plan.segments[1:])``.

Give the formatter and the template the same :class:`PromptLayout` as the pilot when it is not
the default (:func:`document_formatter`, :func:`contextpilot_prompt`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

from langchain_core.documents import Document
from langchain_core.messages import SystemMessage
from langchain_core.prompt_values import ChatPromptValue
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import Runnable, RunnableLambda

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.langchain.documents import planned_entry
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix

__all__ = [
    "CONTEXTPILOT_PROMPT",
    "ContextPilotChatPromptTemplate",
    "ContextPilotPromptValue",
    "RenderedContext",
    "contextpilot_prompt",
    "document_formatter",
    "format_documents",
    "render_context",
]

logger = logging.getLogger(__name__)


class RenderedContext(str):
    """The rendered documents (a ``str``), with the request they were planned for.

    Attributes:
        rid: the plan's request id; ``None`` when the documents were not planned (or came
            from several plans).
        schedule_position: the request's position in its batch's schedule; ``None`` outside
            a batch.
        cache_prefix: the plan's rendered blocks and shared prefix, for a hosted API's cache
            breakpoints (:class:`~contextpilot_integrations.llm_call.cache_prefix.CachePrefix`;
            block ids are not needed there); ``None`` without one plan.
        prompt_cache_key: the plan's OpenAI ``prompt_cache_key``, or ``None``.
    """

    rid: str | None
    schedule_position: int | None
    cache_prefix: CachePrefix | None
    prompt_cache_key: str | None

    def __new__(
        cls,
        text: str,
        *,
        rid: str | None = None,
        schedule_position: int | None = None,
        cache_prefix: CachePrefix | None = None,
        prompt_cache_key: str | None = None,
    ) -> RenderedContext:
        rendered = super().__new__(cls, text)
        rendered.rid = rid
        rendered.schedule_position = schedule_position
        rendered.cache_prefix = cache_prefix
        rendered.prompt_cache_key = prompt_cache_key
        return rendered

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_context,
            (str(self), self.rid, self.schedule_position, self.cache_prefix, self.prompt_cache_key),
        )


def _rebuild_context(
    text: str,
    rid: str | None,
    position: int | None,
    cache_prefix: CachePrefix | None = None,
    key: str | None = None,
) -> RenderedContext:
    return RenderedContext(
        text, rid=rid, schedule_position=position, cache_prefix=cache_prefix, prompt_cache_key=key
    )


def render_context(
    documents: Sequence[Document], layout: PromptLayout | None = None
) -> RenderedContext:
    """Render documents as the context part of the prompt (everything before the question).

    Args:
        documents: as :class:`~.retriever.ContextPilotRetriever` returned them (in the plan's
            output order, :mod:`.documents`). Documents without a ``contextpilot`` entry are
            rendered as blocks in the order given, with no annotation.
        layout: the pilot's layout (default :class:`PromptLayout`).

    Returns:
        For one plan's documents, ``plan.context``: the ``shown`` documents as blocks
        (``layout.render_block(position, page_content)``), then the plan's context tail
        (location hints, order annotation); ``duplicate`` and ``skipped`` documents are not
        rendered. With a question ``q``, ``result + layout.question_template.format(
        question=q) == "".join(plan.segments[1:])``. Documents of several plans: their blocks,
        then their hints (no annotation, no request id).

    Raises:
        TypeError: ``documents`` is not a sequence of ``Document``.
    """
    layout = layout or _DEFAULT_LAYOUT
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise TypeError(
            f"documents must be a list of Document, got {type(documents).__name__}: "
            f"{documents!r:.80}"
        )
    for i, doc in enumerate(documents):
        if not isinstance(doc, Document):
            raise TypeError(f"documents[{i}] must be a Document, got {type(doc).__name__}")
    entries = [planned_entry(doc) for doc in documents]
    rids = {entry.get("rid") for entry in entries if entry is not None}
    one_plan = len(rids) == 1 and all(entry is not None for entry in entries)
    if len(rids) > 1:
        logger.warning(
            "rendering documents of %d different plans together: no request id, no order "
            "annotation (pass one retriever's result to the formatter)",
            len(rids),
        )
    shown = [
        (doc, e) for doc, e in zip(documents, entries) if e is None or e.get("status") == "shown"
    ]
    blocks = []
    for position, (doc, entry) in enumerate(shown):
        if one_plan and entry is not None and entry.get("label") != layout.label(position):
            logger.warning(
                "document at prompt position %d was planned as %r but renders as %r: the "
                "documents were reordered after the retriever or planned with another "
                "PromptLayout; the order annotation may not match",
                position,
                entry.get("label"),
                layout.label(position),
            )
        blocks.append(layout.render_block(position, doc.page_content))
    if one_plan:
        first: Mapping[str, Any] = entries[0]  # type: ignore[assignment]
        prefix = CachePrefix(
            tuple(blocks),
            int(first.get("shared_prefix_blocks") or 0),
            conversation=bool(first.get("conversation")),
        )
        return RenderedContext(
            "".join(blocks) + str(first.get("context_tail", "")),
            rid=first.get("rid"),
            schedule_position=first.get("schedule_position"),
            cache_prefix=prefix,
            prompt_cache_key=first.get("prompt_cache_key"),
        )
    hints = [e["hint"] for e in entries if e is not None and e.get("status") == "replaced"]
    return RenderedContext("".join(blocks) + layout.context_tail(hints=hints))


def document_formatter(
    layout: PromptLayout | None = None,
) -> Runnable[Sequence[Document], RenderedContext]:
    """A runnable ``list[Document] -> RenderedContext`` (:func:`render_context`) for ``layout``."""
    render = functools.partial(render_context, layout=layout)

    async def arender(documents: Sequence[Document]) -> RenderedContext:
        return render(documents)

    return RunnableLambda(render, afunc=arender, name="format_documents")


class ContextPilotPromptValue(ChatPromptValue):
    """A ``ChatPromptValue`` that carries the request id of the plan it was rendered from.

    Attributes:
        rid: the plan's request id (``None``: no plan).
        schedule_position: the request's position in its batch's schedule, or ``None``.
        cache_prefix: the plan's
            :class:`~contextpilot_integrations.llm_call.cache_prefix.CachePrefix` (Anthropic
            breakpoints), or ``None``.
        prompt_cache_key: the plan's OpenAI ``prompt_cache_key``, or ``None``.
    """

    rid: str | None = None
    schedule_position: int | None = None
    cache_prefix: Any = None
    prompt_cache_key: str | None = None


class ContextPilotChatPromptTemplate(ChatPromptTemplate):
    """A ``ChatPromptTemplate`` whose prompt value keeps the request id of a
    :class:`RenderedContext` among its inputs (build one with ``from_messages`` as usual)."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    def format_prompt(self, **kwargs: Any) -> ContextPilotPromptValue:
        return _with_request(super().format_prompt(**kwargs), kwargs)

    async def aformat_prompt(self, **kwargs: Any) -> ContextPilotPromptValue:
        return _with_request(await super().aformat_prompt(**kwargs), kwargs)


def _with_request(value: ChatPromptValue, inputs: Mapping[str, Any]) -> ContextPilotPromptValue:
    contexts = [v for v in inputs.values() if isinstance(v, RenderedContext) and v.rid]
    rids = {c.rid for c in contexts}
    if len(rids) > 1:
        logger.warning("prompt inputs carry %d request ids; sending none", len(rids))
    context = contexts[0] if len(rids) == 1 else None
    return ContextPilotPromptValue(
        messages=value.messages,
        rid=context.rid if context else None,
        schedule_position=context.schedule_position if context else None,
        cache_prefix=context.cache_prefix if context else None,
        prompt_cache_key=context.prompt_cache_key if context else None,
    )


def contextpilot_prompt(
    layout: PromptLayout | None = None,
    *,
    context_key: str = "context",
    history_key: str | None = "history",
) -> ContextPilotChatPromptTemplate:
    """The ready prompt for ``layout``: system prompt, optional history, then one user message.

    Args:
        layout: the pilot's layout (default :class:`PromptLayout`).
        context_key: the input holding the :class:`RenderedContext`.
        history_key: an optional messages input placed between the system prompt and the user
            message (earlier turns); ``None`` for none. Multi-turn de-duplication points at
            earlier turns' documents: the history must then hold those turns' rendered user
            messages (``prompt_value.to_messages()``), not only the questions.

    Returns:
        A template with inputs ``context_key``, ``question`` (and the optional history); the
        user message is ``{context}`` followed by ``layout.question_template``.
    """
    layout = layout or _DEFAULT_LAYOUT
    messages: list[Any] = []
    if layout.system_prompt:
        messages.append(SystemMessage(content=layout.system_prompt))
    if history_key is not None:
        messages.append(MessagesPlaceholder(history_key, optional=True))
    # The layout's question template is a str.format template, the same syntax as the
    # prompt template's f-strings; only the context field is added in front of it.
    messages.append(("human", "{" + context_key + "}" + layout.question_template))
    template = ContextPilotChatPromptTemplate.from_messages(messages)  # from_messages uses cls
    return cast("ContextPilotChatPromptTemplate", template)


_DEFAULT_LAYOUT = PromptLayout()

format_documents = document_formatter()
"""Renders a ``ContextPilotRetriever`` result for the default layout (:func:`render_context`)."""

CONTEXTPILOT_PROMPT = contextpilot_prompt()
"""The ready ``ChatPromptTemplate`` for the default layout (:func:`contextpilot_prompt`)."""
