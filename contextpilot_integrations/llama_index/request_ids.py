"""Request ids: how a plan's ``rid`` reaches the engine call without glue code.

The engine's KV-cache events are tied back to a planned request only if the LLM request
carries its rid (:mod:`contextpilot_integrations.llm_call.engine_fields`). LlamaIndex makes the
LLM call deep inside the response synthesizer, with no per-call arguments, so the rid travels
beside the call (docs/DESIGN.md, "LlamaIndex"):

1. ``ContextPilotNodePostprocessor`` (and the ContextPilot templates, when they render a plan)
   *arm* the plan's request in a :class:`contextvars.ContextVar` of the caller's context;
2. the next LLM request in that context whose prompt contains the start of the plan's first
   block *takes* it, exactly once, before the client's retries
   (:class:`~contextpilot_integrations.llama_index.llms.ContextPilotOpenAILike`); later
   requests, and requests whose prompt does not show the plan, carry none.

The armed request is a shared holder, not a value, so a copied context (a streamed answer's
thread) takes the same one and the id is still sent once.

Where the LLM is called by hand (a Workflow step): ``llm.achat(messages,
**request_id_kwargs(nodes))`` works with any OpenAI-based LlamaIndex LLM (a static
``additional_kwargs["extra_body"]`` replaces a per-call one; use ``ContextPilotOpenAILike``
there). The nodes carry the rid in ``metadata["contextpilot"]["rid"]``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.llm_call.engine_fields import EngineKind, with_engine_fields

__all__ = [
    "PendingRequest",
    "arm_plan",
    "arm_request",
    "nodes_rid",
    "pending_request",
    "request_id_kwargs",
    "take_pending",
    "take_request",
]

MARKER_CHARS = 64
"""Characters of the first block's start used as the marker of a plan's prompt."""


class PendingRequest:
    """A planned request waiting for its LLM call. Taken at most once (thread-safe).

    Attributes:
        rid: the plan's request id.
        markers: texts of which at least one stands in the prompt of the request that may
            take it (the start of the plan's first block); empty: any request may.
        plan: the plan itself when armed by :func:`arm_plan` (the hosted APIs' cache controls
            are placed from it), else ``None``.
    """

    __slots__ = ("_lock", "_taken", "markers", "plan", "rid")

    def __init__(self, rid: str, markers: Sequence[str] = (), plan: Plan | None = None) -> None:
        self.rid = rid
        self.markers = tuple(m for m in markers if m)
        self.plan = plan
        self._taken = False
        self._lock = threading.Lock()

    def take(self, prompt_text: str | None = None) -> str | None:
        """The rid the first time a matching prompt asks, ``None`` otherwise.

        Args:
            prompt_text: the outgoing prompt (chat message contents joined); ``None`` when
                unknown (then only the take-once rule applies).
        """
        if (
            prompt_text is not None
            and self.markers
            and not any(marker in prompt_text for marker in self.markers)
        ):
            return None
        with self._lock:
            if self._taken:
                return None
            self._taken = True
            return self.rid

    @property
    def taken(self) -> bool:
        with self._lock:
            return self._taken

    def __repr__(self) -> str:
        return f"PendingRequest(rid={self.rid!r}, taken={self.taken})"


_PENDING: ContextVar[PendingRequest | None] = ContextVar(
    "contextpilot_pending_request", default=None
)


def arm_request(rid: str | None, markers: Sequence[str] = (), plan: Plan | None = None) -> None:
    """Make ``rid`` the request the next matching LLM call in this context sends (``None``
    disarms). See :class:`PendingRequest` for ``markers`` and ``plan``.

    Arming the rid that is already armed keeps the holder (and whether it was taken), so a
    template rendering the same plan twice does not send the id twice.
    """
    current = _PENDING.get()
    if rid is None:
        if current is not None:
            _PENDING.set(None)
        return
    if current is not None and current.rid == rid:
        return
    _PENDING.set(PendingRequest(rid, markers, plan))


def arm_plan(plan: Plan) -> None:
    """Arm ``plan``'s request for the LLM call whose prompt shows it: its markers are the start
    of its first block as the ContextPilot templates render it and as LlamaIndex's stock
    templates do, else its first hint. A plan whose prompt shows nothing (every node without
    text) disarms instead: no prompt can be told to be its own."""
    if plan.blocks:
        first = plan.blocks[0]
        texts = (first.rendered_text or "", first.text)
        arm_request(plan.rid, tuple(dict.fromkeys(t[:MARKER_CHARS] for t in texts)), plan)
    elif plan.hints:
        arm_request(plan.rid, plan.hints[:1], plan)
    else:
        arm_request(None)


def pending_request() -> PendingRequest | None:
    """The request armed in this context (taken or not), or ``None``."""
    return _PENDING.get()


def take_request(prompt_text: str | None = None) -> str | None:
    """Take the armed request's rid for the LLM call being made now, whose prompt is
    ``prompt_text`` (``None``: none armed, already taken, or the prompt does not show the
    plan)."""
    taken = take_pending(prompt_text)
    return taken.rid if taken is not None else None


def take_pending(prompt_text: str | None = None) -> PendingRequest | None:
    """:func:`take_request`, returning the taken :class:`PendingRequest` (with its plan)."""
    current = _PENDING.get()
    if current is None or current.take(prompt_text) is None:
        return None
    return current


def nodes_rid(nodes: Sequence[Any]) -> str | None:
    """The plan rid the nodes carry (``metadata["contextpilot"]["rid"]``), ``None`` when none
    does (an empty list, nodes that were not planned).

    Args:
        nodes: ``NodeWithScore`` or ``BaseNode`` objects.

    Raises:
        ValueError: the nodes carry more than one rid (they come from different plans).
    """
    rids = set()
    for item in nodes:
        node = getattr(item, "node", item)
        metadata: Mapping[str, Any] = getattr(node, "metadata", None) or {}
        entry = metadata.get(METADATA_KEY)
        rid = entry.get("rid") if isinstance(entry, Mapping) else None
        if isinstance(rid, str):
            rids.add(rid)
    if len(rids) > 1:
        raise ValueError(f"nodes carry {len(rids)} different request ids: {sorted(rids)[:4]!r}")
    return rids.pop() if rids else None


def request_id_kwargs(
    nodes_or_rid: str | Sequence[Any], engine: EngineKind = "any"
) -> dict[str, Any]:
    """Per-call LLM keyword arguments that send a plan's request id: ``{"extra_body": {...}}``.

    Args:
        nodes_or_rid: the rid, or nodes returned by ``ContextPilotNodePostprocessor``
            (:func:`nodes_rid`).
        engine: whose body fields carry it
            (:func:`contextpilot_integrations.llm_call.engine_fields.engine_body_fields`).

    Returns:
        ``{"extra_body": {field: rid, ...}}``, or ``{}`` when the nodes carry no rid.

    Raises:
        ValueError: the nodes carry more than one rid, or an unknown ``engine``.
        TypeError: ``nodes_or_rid`` is an empty str.
    """
    rid = nodes_or_rid if isinstance(nodes_or_rid, str) else nodes_rid(nodes_or_rid)
    return {} if rid is None else with_engine_fields({}, rid, engine)
