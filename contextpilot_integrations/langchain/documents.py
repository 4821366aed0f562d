"""A plan as LangChain documents: copies in prompt order, each with a ``contextpilot`` entry.

:func:`planned_documents` turns the retriever's documents and the
:class:`~contextpilot_integrations.Plan` made from their texts into what
:class:`~.retriever.ContextPilotRetriever` returns:

- copies (``Document.model_copy``), never the retriever's own objects, whose metadata is a new
  dict holding the caller's entries (by reference, so values that are not JSON-serialisable are
  kept as they are) plus one namespaced entry, ``metadata["contextpilot"]`` (:data:`METADATA_KEY`);
- first the blocks the prompt shows, in prompt order, then the blocks replaced by a location
  hint (multi-turn de-duplication), in the order their hints are rendered;
- ``page_content`` is always the text the model reads: the original text, the text with repeated
  sub-blocks replaced by pointers, or the hint. When it differs from the retriever's text, the
  original is kept in the entry (``original_page_content``). Nothing is lost (DESIGN.md
  invariant 1): a document whose text repeats an earlier document of the same result is folded
  into that one and listed in its ``duplicate_ranks``.

The entry is plain JSON (str, int, bool, list, None), so tracers can record it:

========================  =======================================================================
key                       meaning
========================  =======================================================================
``rid``                   request id of the plan; send it to the engine (:mod:`.request_ids`)
``block_id``              stable unsigned 64-bit id of the retriever's text (``core.blocks``)
``original_rank``         0-based position in the retriever's result
``position``              0-based prompt position among the shown blocks; ``None`` when replaced
``label``                 the block's label in the prompt (``"[Doc 2]"``); ``None`` when replaced
``replaced``              ``True`` when the whole block is replaced by a location hint
``hint``                  the hint (== ``page_content``) when replaced
``sub_blocks_replaced``   ``True`` when parts of the block were replaced by pointers
``original_page_content`` the retriever's text, only when ``page_content`` differs from it
``duplicate_ranks``       original ranks of identical documents folded into this one
``matched_prefix_blocks`` blocks of the prompt prefix the context index already held
``context_tail``          what the prompt renders after the blocks and before the question
                          (location hints, order annotation); the same on every document of a plan
``conversation_id``,      the conversation the plan was de-duplicated in (only with one)
``tenant``, ``turn``
``schedule_position``     batch only: 0-based position of this request in the batch's schedule
========================  =======================================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document

from contextpilot_integrations.core.blocks import block_id
from contextpilot_integrations.core.pilot import Plan

__all__ = ["METADATA_KEY", "planned_documents", "planned_entry"]

METADATA_KEY = "contextpilot"
"""The metadata key of the entry ContextPilot adds to each returned document."""


def planned_documents(
    documents: Sequence[Document],
    plan: Plan,
    *,
    schedule_position: int | None = None,
) -> list[Document]:
    """Copies of ``documents`` in prompt order, each with its :data:`METADATA_KEY` entry.

    Args:
        documents: the retriever's documents, in retriever order; ``plan`` was made from their
            ``page_content`` in that order.
        plan: the plan.
        schedule_position: the request's position in its batch's schedule (batch calls only).

    Returns:
        ``len(plan.blocks) + len(plan.replaced)`` documents: the shown blocks in prompt order,
        then the replaced ones in hint order, then any documents with empty ``page_content``
        (not planned: marked ``skipped``).

    Raises:
        ValueError: ``plan`` does not account for every document exactly once (a plan made
            from other documents).
    """
    empty = [i for i, d in enumerate(documents) if not has_text(d)]
    if empty:
        # Documents without text are not context blocks: they were not planned and come back
        # last, unchanged but marked, so nothing given in is lost.
        texted = [d for d in documents if has_text(d)]
        out = planned_documents(texted, plan, schedule_position=schedule_position)
        for i in empty:
            entry = {"rid": plan.rid, "original_rank": i, "skipped": "empty page_content"}
            out.append(_copy(documents[i], documents[i].page_content, entry))
        return out
    expected = len(plan.order) + len(plan.duplicates) + len(plan.replaced)
    if expected != len(documents):
        raise ValueError(
            f"the plan covers {expected} blocks but {len(documents)} documents were given"
        )
    folded: dict[int, list[int]] = {}
    for rank, first in sorted(plan.duplicates.items()):
        folded.setdefault(first, []).append(rank)
    shared = _plan_fields(plan, schedule_position)

    out: list[Document] = []
    for position, block in enumerate(plan.blocks):
        source = documents[block.original_rank]
        entry = {
            "rid": plan.rid,
            "block_id": block.block_id,
            "original_rank": block.original_rank,
            "position": position,
            "label": plan.layout.label(position),
            "replaced": False,
            "sub_blocks_replaced": block.rendered_text != block.text,
            "duplicate_ranks": folded.get(block.original_rank, []),
            **shared,
        }
        if block.rendered_text != block.text:
            entry["original_page_content"] = source.page_content
        out.append(_copy(source, block.rendered_text, entry))

    hint_order = {hint: i for i, hint in enumerate(plan.hints)}
    for rank, hint in sorted(plan.replaced.items(), key=lambda item: hint_order.get(item[1], 0)):
        source = documents[rank]
        entry = {
            "rid": plan.rid,
            "block_id": block_id(source.page_content),
            "original_rank": rank,
            "position": None,
            "label": None,
            "replaced": True,
            "hint": hint,
            "sub_blocks_replaced": False,
            "duplicate_ranks": folded.get(rank, []),
            "original_page_content": source.page_content,
            **shared,
        }
        out.append(_copy(source, hint, entry))
    return out


def has_text(document: Document) -> bool:
    """Whether a document is a context block (non-empty, not only whitespace)."""
    return bool(document.page_content) and not document.page_content.isspace()


def block_texts(documents: Sequence[Document]) -> list[str]:
    """The texts to plan: each document's ``page_content``, skipping empty ones."""
    return [d.page_content for d in documents if has_text(d)]


def planned_entry(document: Document) -> Mapping[str, Any] | None:
    """The :data:`METADATA_KEY` entry of ``document``, or ``None`` when it has none."""
    entry = document.metadata.get(METADATA_KEY) if document.metadata else None
    return entry if isinstance(entry, Mapping) else None


def _plan_fields(plan: Plan, schedule_position: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "matched_prefix_blocks": plan.matched_prefix_blocks,
        "context_tail": _context_tail(plan),
    }
    if plan.conversation_id is not None:
        fields.update(conversation_id=plan.conversation_id, tenant=plan.tenant, turn=plan.turn)
    if schedule_position is not None:
        fields["schedule_position"] = schedule_position
    return fields


def _context_tail(plan: Plan) -> str:
    """The plan's last segment without the question: hints and order annotation."""
    tail = plan.segments[-1]
    question = plan.layout.question_template.format(question=plan.query)
    if not tail.endswith(question):  # the layout renders the question last (rendering.py)
        raise ValueError(f"plan {plan.rid!r}: the last segment does not end with the question")
    return tail[: len(tail) - len(question)]


def _copy(source: Document, page_content: str, entry: dict[str, Any]) -> Document:
    metadata = dict(source.metadata) if source.metadata else {}
    metadata[METADATA_KEY] = entry
    return source.model_copy(update={"page_content": page_content, "metadata": metadata})
