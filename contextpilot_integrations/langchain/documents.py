"""A plan as LangChain documents: one copy per input document, in the plan's output order.

:func:`planned_documents` turns the retriever's documents and the
:class:`~contextpilot_integrations.Plan` made from their texts into what
:class:`~.retriever.ContextPilotRetriever` returns: for every input document exactly one copy
(``Document.model_copy``, never the retriever's own object), in
:meth:`Plan.output_order <contextpilot_integrations.core.plan.Plan.output_order>`: the blocks the
prompt shows (prompt order), the blocks replaced by a location hint (hint order), duplicates,
then skipped documents (input order). Nothing is lost (DESIGN.md invariant 1).

``page_content`` is what the prompt shows for the document:

- ``shown``: its text, or the text with sub-blocks already shown earlier in the conversation
  replaced by pointers;
- ``replaced``: the location hint;
- ``duplicate``: its own text, unchanged. A document whose text repeats an earlier document of
  the same result comes back as its own document (its id and metadata kept), not folded into
  the first one: :data:`~.prompts.format_documents` renders only ``shown`` documents as blocks,
  so the prompt shows the text once, under the label of the document in ``duplicate_of``. A
  formatter of your own must skip ``duplicate`` (and ``skipped``) documents as well;
- ``skipped`` (empty or whitespace-only text, not a context block): its text, unchanged.

Each copy's metadata is a new dict holding the caller's entries (by reference, so values that
are not JSON-serialisable are kept as they are) plus ``metadata["contextpilot"]``: the entry
every face attaches (:mod:`contextpilot_integrations.core.placement_metadata`: ``rid``, ``index``,
``status``, ``position``, ``label``, ``block_id``, ``hint``, ``duplicate_of``) and the keys
LangChain needs in addition:

=========================  ======================================================================
key                        meaning
=========================  ======================================================================
``context_tail``           what the prompt renders after the blocks and before the question
                           (location hints, order annotation; ``Plan.context_tail``); the same on
                           every document of a plan
``original_page_content``  the retriever's text, only where ``page_content`` differs from it
                           (``replaced``; ``shown`` with sub-block pointers)
``schedule_position``      batch only: 0-based position of the request in the batch's schedule
``shared_prefix_blocks``   the plan's ``shared_prefix_blocks`` (where a hosted API's cache
                           breakpoint goes; :mod:`contextpilot_integrations.llm_call.hosted_cache`)
``conversation``           whether the plan is a turn of a conversation
``prompt_cache_key``       the plan's OpenAI ``prompt_cache_key`` (``hosted_cache``)
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
    # The hosted APIs' cache controls (with_request_id(engine="anthropic" | "openai")) see only
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
            # with_request_id sends a batch's LLM calls in schedule order, and sees only the
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
