"""Mem0 scoping (``user_id``, ``agent_id``, ``run_id``) mapped to ContextPilot's tenant and
conversation.

Mem0 (``mem0ai`` 2.2) scopes every memory by up to three entity ids, given to ``search`` as
``filters={"user_id": ..., "agent_id": ..., "run_id": ...}``. Multi-turn de-duplication is per
``(tenant, conversation_id)`` (DESIGN.md invariant 2). The mapping:

- tenant: every entity id of the filters, encoded as ``"user_id=<u>&agent_id=<a>&run_id=<r>"``
  (only those given, in that order; ``%``, ``&`` and ``=`` inside a value percent-encoded, as
  Mem0's own session scope key does), ``""`` when none is given;
- conversation: the conversation id the application gives, else the ``run_id`` (Mem0's session
  or run), else ``None``, which means no de-duplication across searches. An application that
  keeps memories per user (``filters={"user_id": ...}``, so that every session sees them) names
  its conversation explicitly: a ``run_id`` in the filters would also restrict Mem0's search to
  that run's memories.

Two scopes differing in any of the three ids never share a tenant, so one user's (or agent's,
or run's) memories are never de-duplicated against another's. Entity ids are normalised as
Mem0 normalises them (``str(value).strip()``), so ids Mem0 treats as the same map to the same
tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ENTITY_KEYS", "MemoryScope", "memory_scope"]

ENTITY_KEYS = ("user_id", "agent_id", "run_id")
"""Mem0's entity ids, in the order the tenant encodes them."""


@dataclass(frozen=True, slots=True)
class MemoryScope:
    """Where a Mem0 search is de-duplicated.

    Attributes:
        tenant: the encoded entity ids (``""`` when none is given).
        conversation_id: the conversation, or ``None`` (no de-duplication across searches).
    """

    tenant: str
    conversation_id: str | None


def _escape(value: str) -> str:
    return value.replace("%", "%25").replace("&", "%26").replace("=", "%3D")


def _entity(filters: Mapping[str, Any], key: str) -> str | None:
    value = filters.get(key)
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def memory_scope(
    filters: Mapping[str, Any] | None, conversation_id: str | None = None
) -> MemoryScope:
    """The tenant and conversation of a Mem0 ``filters`` dict.

    Args:
        filters: Mem0 search filters; keys other than the entity ids (metadata filters,
            ``actor_id``, ``AND``/``OR``/``NOT``) select memories and do not change the scope.
        conversation_id: the application's conversation id (default: the ``run_id``).

    Returns:
        The :class:`MemoryScope`.

    Raises:
        TypeError: ``filters`` is neither ``None`` nor a mapping, or ``conversation_id`` is
            neither ``None`` nor a str.
    """
    if conversation_id is not None and not isinstance(conversation_id, str):
        raise TypeError(
            f"conversation_id must be a str or None, got {type(conversation_id).__name__}: "
            f"{conversation_id!r:.200}"
        )
    if filters is None:
        return MemoryScope("", conversation_id)
    if not isinstance(filters, Mapping):
        raise TypeError(
            f"filters must be a dict or None, got {type(filters).__name__}: {filters!r:.200}"
        )
    parts = []
    for key in ENTITY_KEYS:
        value = _entity(filters, key)
        if value is not None:
            parts.append(f"{key}={_escape(value)}")
    conversation = conversation_id if conversation_id is not None else _entity(filters, "run_id")
    return MemoryScope("&".join(parts), conversation)
