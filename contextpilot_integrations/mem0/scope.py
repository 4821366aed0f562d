"""Mem0 scoping (``user_id``, ``agent_id``, ``run_id``) mapped to the core's :class:`Scope`.

Mem0 (``mem0ai`` 2.2) scopes every memory by up to three entity ids, given to ``search`` as
``filters={"user_id": ..., "agent_id": ..., "run_id": ...}``. Multi-turn de-duplication is per
``(tenant, conversation_id)`` (docs/DESIGN.md, "Isolation"). :func:`scope_from_filters` maps:

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
from typing import Any

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.request import Scope

__all__ = ["ENTITY_KEYS", "scope_from_filters"]

ENTITY_KEYS = ("user_id", "agent_id", "run_id")
"""Mem0's entity ids, in the order the tenant encodes them."""


def _escape(value: str) -> str:
    return value.replace("%", "%25").replace("&", "%26").replace("=", "%3D")


def _entity(filters: Mapping[str, Any], key: str) -> str | None:
    value = filters.get(key)
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def scope_from_filters(
    filters: Mapping[str, Any] | None,
    conversation_id: str | None = None,
    *,
    turn: int | None = None,
    visibility: TurnVisibility | None = None,
) -> Scope:
    """The :class:`Scope` of a Mem0 search.

    Args:
        filters: Mem0 search filters; keys other than the entity ids (metadata filters,
            ``actor_id``, ``AND``/``OR``/``NOT``) select memories and do not change the scope.
        conversation_id: the application's conversation id (default: the ``run_id``).
        turn: the conversation turn (default: one after the latest); needs a conversation.
        visibility: which earlier turns the prompt still holds (default: all). Ignored when
            the search has no conversation: nothing is de-duplicated then, so no earlier turn
            is referred to (a wrapper's default visibility thus applies to the searches that
            have one).

    Returns:
        ``Scope(conversation_id, tenant, turn, visibility)``.

    Raises:
        TypeError: ``filters`` is neither ``None`` nor a mapping; from :class:`Scope`, a
            ``conversation_id``, ``turn`` or ``visibility`` of the wrong type.
        ValueError: from :class:`Scope`: a ``turn`` without a conversation, a bad value.
    """
    if filters is None:
        filters = {}
    elif not isinstance(filters, Mapping):
        raise TypeError(
            f"filters must be a dict or None, got {type(filters).__name__}: {filters!r:.200}"
        )
    parts = []
    for key in ENTITY_KEYS:
        value = _entity(filters, key)
        if value is not None:
            parts.append(f"{key}={_escape(value)}")
    conversation = conversation_id if conversation_id is not None else _entity(filters, "run_id")
    return Scope(
        conversation_id=conversation,
        tenant="&".join(parts),
        turn=turn,
        visibility=visibility if conversation is not None else None,
    )
