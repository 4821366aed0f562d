"""The one metadata layout every face attaches to the objects it returns.

LangChain documents (``metadata["contextpilot"]``), LlamaIndex nodes (``metadata["contextpilot"]``,
excluded from the LLM and embedding text) and Mem0 results (``result["contextpilot"]``) carry the
same entry, built from the plan's :class:`~contextpilot_integrations.core.plan.Placement` of
that input:

================  ================================================================================
key               meaning
================  ================================================================================
``rid``           the plan's request id; send it with the LLM call (:mod:`.engine_fields`)
``index``         0-based position of the object in what the framework gave (retriever rank)
``status``        ``"shown"``, ``"replaced"`` (by a location hint), ``"duplicate"`` (of an
                  earlier object with the same text) or ``"skipped"`` (empty text, not planned)
``position``      shown: 0-based prompt position; replaced: position of its hint; else ``None``
``label``         shown: the block's label in the prompt (``"[Doc 2]"``); else ``None``
``block_id``      stable unsigned 64-bit id of the object's text; ``None`` when skipped
``hint``          replaced: the hint the prompt shows instead of the text; else ``None``
``duplicate_of``  duplicate: ``index`` of the object that stands for it; else ``None``
================  ================================================================================

Plain JSON values (str, int, None), so tracers can record the entry.
"""

from __future__ import annotations

from typing import Any

from contextpilot_integrations.core.plan import Placement, Plan

__all__ = ["METADATA_KEY", "PLACEMENT_KEYS", "placement_entry"]

METADATA_KEY = "contextpilot"
"""The key under which every face stores the entry."""

PLACEMENT_KEYS = ("rid", "index", "status", "position", "label", "block_id", "hint", "duplicate_of")
"""The entry's keys, in this order."""


def placement_entry(plan: Plan, placement: Placement) -> dict[str, Any]:
    """The metadata entry of one input of ``plan`` (keys: :data:`PLACEMENT_KEYS`)."""
    return {
        "rid": plan.rid,
        "index": placement.index,
        "status": placement.status.value,
        "position": placement.position,
        "label": placement.label,
        "block_id": placement.block_id,
        "hint": placement.hint,
        "duplicate_of": placement.duplicate_of,
    }
