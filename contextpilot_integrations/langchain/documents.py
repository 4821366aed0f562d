"""A plan as LangChain documents: one copy per input document, in the plan's output order.

:func:`planned_documents` turns the retriever's documents and the
:class:`~contextpilot_integrations.Plan` made from their texts into what
:class:`~.retriever.ContextPilotRetriever` returns: one copy of every input document (never the
retriever's own object), in :meth:`Plan.output_order
<contextpilot_integrations.core.plan.Plan.output_order>` (docs/DESIGN.md, "Lossless"). Its
``page_content`` is what the prompt shows: for ``shown`` its text (sub-blocks shown earlier
replaced by pointers), for ``replaced`` the location hint; ``duplicate`` and ``skipped``
documents keep their text, and a formatter must not render them (the prompt shows a duplicate
once, under the label in ``duplicate_of``).

Each copy's metadata is a new dict with the caller's entries (by reference) plus
``metadata["contextpilot"]``: the placement entry of every face
(:mod:`contextpilot_integrations.core.placement_metadata`) and the keys the formatter and the
model wrapper need, since they never see the plan:

=========================  ======================================================================
key                        meaning
=========================  ======================================================================
``context_tail``           what the prompt renders after the blocks and before the question
                           (``Plan.context_tail``); the same on every document of a plan
``original_page_content``  the retriever's text, only where ``page_content`` differs from it
``schedule_position``      batch only: 0-based position of the request in the batch's schedule
``shared_prefix_blocks``   the plan's ``shared_prefix_blocks`` (a hosted API's cache breakpoint)
``conversation``           whether the plan is a turn of a conversation
``prompt_cache_key``       the plan's OpenAI ``prompt_cache_key``
=========================  ======================================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document

from contextpilot_integrations.core.placement_metadata import METADATA_KEY, placement_entry
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.openai_cache_key import prompt_cache_key

__all__ = ["planned_documents", "planned_entry"]


def planned_documents(
    documents: Sequence[Document],
    plan: Plan,
    *,
    schedule_position: int | None = None,
) -> list[Document]:
    """Copies of ``documents`` in ``plan.output_order()``, each with its
    ``metadata["contextpilot"]`` entry (see the module docstring).

    Args:
        documents: the retriever's documents, in retriever order; ``plan`` was made from their
            ``page_content`` in that order.
        plan: the plan.
        schedule_position: the request's position in its batch's schedule (batch calls only).

    Returns:
        ``len(documents)`` documents.

    Raises:
        ValueError: ``plan`` was made for another number of blocks than ``documents``.
    """
    if len(plan.placements) != len(documents):
        raise ValueError(
            f"the plan covers {len(plan.placements)} blocks but {len(documents)} documents "
            "were given"
        )
    # format_documents sees only the documents, not the plan: it renders the tail after the
    # shown blocks, so the context equals the plan's prompt byte for byte.
    context_tail = plan.context_tail
    # The hosted APIs' cache controls (with_plan_fields(engine="anthropic" | "openai")) see only
    # the prompt value too: the plan-level figures they place breakpoints and keys by.
    hosted = {
        "shared_prefix_blocks": plan.shared_prefix_blocks,
        "conversation": plan.scope.conversation_id is not None,
        "prompt_cache_key": prompt_cache_key(CachePrefix.of(plan)),
    }
    out = []
    for placement in plan.output_order():
        source = documents[placement.index]
        entry = placement_entry(plan, placement)
        entry["context_tail"] = context_tail
        entry.update(hosted)
        page_content = placement.prompt_text
        if page_content is None:  # a duplicate or skipped document keeps its text
            page_content = source.page_content
        elif page_content != source.page_content:
            # A Document has one text field, and it holds what the prompt shows: keep the
            # retriever's text for the app (citations, display), which has no plan to look in.
            entry["original_page_content"] = source.page_content
        if schedule_position is not None:
            # with_plan_fields sends a batch's LLM calls in schedule order, and sees only the
            # prompt value built from these documents.
            entry["schedule_position"] = schedule_position
        metadata = dict(source.metadata) if source.metadata else {}
        metadata[METADATA_KEY] = entry
        out.append(source.model_copy(update={"page_content": page_content, "metadata": metadata}))
    return out


def planned_entry(document: Document) -> Mapping[str, Any] | None:
    """The ``metadata["contextpilot"]`` entry of ``document``, or ``None`` when it has none."""
    entry = document.metadata.get(METADATA_KEY) if document.metadata else None
    return entry if isinstance(entry, Mapping) else None
