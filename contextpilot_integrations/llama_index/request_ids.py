"""Request ids: how a plan's ``rid`` reaches the engine call without glue code.

Why: the context index files each planned request under ``plan.rid``; the engine's KV-cache
events and evictions are tied back to it only if the LLM request carries that id (SGLang
``rid``, vLLM ``request_id``, both ``session_id``; ``../shared/notes/engine-kv-events.md``,
"Request ids on the OpenAI-compatible APIs"). In a LlamaIndex query or chat engine the LLM
call is made deep inside the response synthesizer, which passes no per-call arguments to the
LLM; so the id travels beside the call instead of through it:

1. ``ContextPilotNodePostprocessor`` plans the nodes and *arms* the plan's request in a
   :class:`contextvars.ContextVar` of the caller's context (the thread, or the asyncio task,
   that runs the query). The ContextPilot prompt templates arm it again when they render a
   plan, so the id follows the prompt that shows the plan's blocks.
2. The next LLM request made in that context whose prompt shows the plan's blocks *takes*
   it, exactly once: :class:`~contextpilot_integrations.llama_index.llms.ContextPilotOpenAILike`
   (an ``OpenAILike`` that adds the fields to ``extra_body``) takes it when ``chat``/``complete``
   (sync, async, streaming) is called, before the client's retries, so a retried request keeps
   its id; the following request (the next turn's question condensing) carries none, and so
   does a request whose prompt does not contain the start of the plan's first block (a call
   that has nothing to do with the plan, made after a retrieval that was never answered).

The armed request is a shared holder, not a value: a copied context (LlamaIndex runs streamed
answers in a context-copying thread) takes the same holder, so the id is still sent once.

Where the LLM is called by hand (a Workflow step), pass the id explicitly:
``llm.achat(messages, **request_id_kwargs(nodes))`` works with any OpenAI-based LlamaIndex LLM
(note: a static ``additional_kwargs["extra_body"]`` on the LLM replaces a per-call one; use
``ContextPilotOpenAILike`` there).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from contextpilot_integrations.core.pilot import Plan

__all__ = [
    "DEFAULT_REQUEST_ID_FIELDS",
    "RID_METADATA_KEY",
    "PendingRequest",
    "arm_request",
    "pending_request",
    "plan_markers",
    "request_id_fields",
    "request_id_kwargs",
    "take_request",
]

DEFAULT_REQUEST_ID_FIELDS: tuple[str, ...] = ("rid", "request_id", "session_id")
"""Body fields that carry the request id: SGLang ``rid`` (all 0.5.x), vLLM ``request_id``, and
``session_id`` (SGLang 0.5.15+, recent vLLM; echoed on ``BlockStored`` events, which is how the
cache mirror attributes stored blocks to the request)."""

RID_METADATA_KEY = "contextpilot_rid"
"""Node metadata key holding the plan's request id (excluded from LLM and embed rendering)."""


class PendingRequest:
    """A planned request waiting for its LLM call. Taken at most once (thread-safe).

    Attributes:
        rid: the plan's request id.
        markers: texts of which at least one stands in the prompt of the request that may
            take it (the start of the plan's first block); empty: any request may.
    """

    __slots__ = ("_lock", "_taken", "markers", "rid")

    def __init__(self, rid: str, markers: Sequence[str] = ()) -> None:
        self.rid = rid
        self.markers = tuple(m for m in markers if m)
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

MARKER_CHARS = 64
"""Characters of the first block's start used as the marker of a plan's prompt."""


def plan_markers(plan: Plan) -> tuple[str, ...]:
    """Texts that stand in any prompt rendering ``plan``: the start of its first block as the
    ContextPilot templates render it and as LlamaIndex's stock templates do; else its first
    hint; empty for a plan with neither."""
    if plan.blocks:
        first = plan.blocks[0]
        return tuple(dict.fromkeys((first.rendered_text[:MARKER_CHARS], first.text[:MARKER_CHARS])))
    return (plan.hints[0],) if plan.hints else ()


def arm_request(rid: str | None, markers: Sequence[str] = ()) -> None:
    """Make ``rid`` the request the next matching LLM call in this context sends (``None``
    disarms). See :class:`PendingRequest` for ``markers``.

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
    _PENDING.set(PendingRequest(rid, markers))


def pending_request() -> PendingRequest | None:
    """The request armed in this context (taken or not), or ``None``."""
    return _PENDING.get()


def take_request(prompt_text: str | None = None) -> str | None:
    """Take the armed request's rid for the LLM call being made now, whose prompt is
    ``prompt_text`` (``None``: none armed, already taken, or the prompt does not show the
    plan)."""
    current = _PENDING.get()
    return current.take(prompt_text) if current is not None else None


def request_id_fields(
    rid: str, fields: Sequence[str] = DEFAULT_REQUEST_ID_FIELDS
) -> dict[str, str]:
    """``{field: rid for field in fields}``, the body fields an OpenAI-compatible engine reads.

    Raises:
        ValueError: ``rid`` is not a non-empty ``str``, or a field name is not a non-empty ``str``.
    """
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"rid must be a non-empty str, got {rid!r}")
    for name in fields:
        if not isinstance(name, str) or not name:
            raise ValueError(f"request id field names must be non-empty str, got {name!r}")
    return {name: rid for name in fields}


def request_id_kwargs(
    nodes_or_rid: str | Sequence[Any],
    fields: Sequence[str] = DEFAULT_REQUEST_ID_FIELDS,
) -> dict[str, dict[str, str]]:
    """Per-call LLM keyword arguments that send a plan's request id: ``{"extra_body": {...}}``.

    Args:
        nodes_or_rid: the rid, or nodes returned by ``ContextPilotNodePostprocessor`` (the rid
            is read from their ``contextpilot_rid`` metadata).
        fields: body field names (default :data:`DEFAULT_REQUEST_ID_FIELDS`).

    Returns:
        ``{"extra_body": {field: rid, ...}}``, or ``{}`` when the nodes carry no rid (an empty
        list, or nodes that were not planned).

    Raises:
        ValueError: the nodes carry more than one rid (they come from different plans).
    """
    if isinstance(nodes_or_rid, str):
        return {"extra_body": request_id_fields(nodes_or_rid, fields)}
    rids = set()
    for item in nodes_or_rid:
        node = getattr(item, "node", item)
        metadata: Mapping[str, Any] = getattr(node, "metadata", None) or {}
        rid = metadata.get(RID_METADATA_KEY)
        if rid is not None:
            rids.add(rid)
    if not rids:
        return {}
    if len(rids) > 1:
        raise ValueError(f"nodes carry {len(rids)} different request ids: {sorted(rids)[:4]!r}")
    return {"extra_body": request_id_fields(rids.pop(), fields)}
