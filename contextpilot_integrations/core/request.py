"""The request type: what one LLM call asks the planner to arrange, validated in one place.

A :class:`PlanRequest` is a question, its context blocks in retriever (relevance) order, an
optional request id and one :class:`Scope` (conversation id, tenant, turn, visibility). A
batch is a list of requests. The same type is planned in process
(:meth:`~contextpilot_integrations.core.pilot.ContextPilot.plan_batch`), sent by both service
clients and read by the service (its wire form, :mod:`contextpilot_integrations.client.schemas`,
converts to it field for field), so every check below runs wherever a request enters the
library and names the field and the value.

Blocks that are empty or only whitespace are accepted: they are not context blocks, the plan
marks them ``skipped`` and hands them back (docs/DESIGN.md, "Lossless": nothing given in is lost).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from contextpilot_integrations.core.conversations.turns import MAX_TURN, TurnVisibility

__all__ = [
    "MAX_BLOCKS_PER_REQUEST",
    "MAX_ID_CHARS",
    "NO_SCOPE",
    "PlanRequest",
    "RidConflictError",
    "Scope",
    "check_batch",
    "is_block_text",
    "new_rid",
]

MAX_BLOCKS_PER_REQUEST = 100_000
"""Most blocks in one request."""

MAX_ID_CHARS = 512
"""Longest rid, conversation id or tenant, in characters."""
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"
"""The C0 and C1 control characters as a regular-expression character range: refused in ids
(the service's schema states the same rule as a pattern)."""
_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")


class RidConflictError(ValueError):
    """A rid that is already indexed, or that a concurrent call is planning (HTTP 409)."""


def new_rid() -> str:
    """A new unique request id (``"cp-"`` and 32 hex digits: 128 random bits, read from the
    system's random source directly; ``uuid.uuid4`` would cost a UUID object per plan,
    docs/DESIGN.md, "Hot path")."""
    return f"cp-{os.urandom(16).hex()}"


def is_block_text(text: str) -> bool:
    """Whether ``text`` is a context block (not empty, not only whitespace)."""
    return bool(text) and not text.isspace()


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a request belongs: its conversation (for multi-turn de-duplication) and tenant.

    Attributes:
        conversation_id: the conversation this request is a turn of; ``None``: none, nothing
            is de-duplicated across requests or recorded (docs/DESIGN.md, "Isolation").
        tenant: the owner (user, app) of the conversation; different tenants never see each
            other's conversations. In the service it comes from the API key, never the body.
        turn: this turn's number (``int >= 0``); ``None``: one after the conversation's latest.
            On a plan, the number the turn was planned as.
        visibility: which earlier turns the app's prompt still holds; ``None``: all. A hint
            only ever points at a visible turn.

    Raises:
        TypeError / ValueError: a field of the wrong type or value, or ``turn`` /
            ``visibility`` without a ``conversation_id`` (the message names the field).
    """

    conversation_id: str | None = None
    tenant: str = ""
    turn: int | None = None
    visibility: TurnVisibility | None = None

    def __post_init__(self) -> None:
        _check_id("scope.conversation_id", self.conversation_id, optional=True)
        if not isinstance(self.tenant, str):
            raise TypeError(
                f"scope.tenant must be a str, got {type(self.tenant).__name__}: {self.tenant!r:.80}"
            )
        if len(self.tenant) > MAX_ID_CHARS:
            raise ValueError(f"scope.tenant is longer than {MAX_ID_CHARS} characters")
        if self.tenant:
            _check_id("scope.tenant", self.tenant, optional=False)
        if self.turn is not None:
            if isinstance(self.turn, bool) or not isinstance(self.turn, int):
                raise TypeError(
                    f"scope.turn must be an int or None, got {type(self.turn).__name__}: "
                    f"{self.turn!r:.80}"
                )
            if not 0 <= self.turn <= MAX_TURN:
                raise ValueError(f"scope.turn must be in 0..{MAX_TURN}, got {self.turn}")
        if self.visibility is not None and not isinstance(self.visibility, TurnVisibility):
            raise TypeError(
                f"scope.visibility must be a TurnVisibility or None, got "
                f"{type(self.visibility).__name__}"
            )
        if self.conversation_id is None:
            for name, value in (("turn", self.turn), ("visibility", self.visibility)):
                if value is not None:
                    raise ValueError(f"scope.{name}={value!r} needs a scope.conversation_id")

    @property
    def conversation(self) -> tuple[str, str] | None:
        """``(tenant, conversation_id)``, the conversation store's key; ``None`` without one."""
        if self.conversation_id is None:
            return None
        return self.tenant, self.conversation_id


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """One request to plan.

    Attributes:
        query: the question (a str; may be empty).
        blocks: block texts in retriever (relevance) order; a sequence of str, stored as a
            tuple. Identical texts are shown once (the later ones are ``duplicate``); empty or
            whitespace-only texts are ``skipped``.
        rid: the request id to index the plan under; ``None``: a new unique one.
        scope: the conversation and tenant.

    Raises:
        TypeError / ValueError: a bad field; the message names it (``blocks[3]``) and the value.
    """

    query: str
    blocks: Sequence[str]
    rid: str | None = None
    scope: Scope = field(default_factory=Scope)

    def __post_init__(self) -> None:
        if not isinstance(self.query, str):
            raise TypeError(
                f"query must be a str, got {type(self.query).__name__}: {self.query!r:.80}"
            )
        _check_utf8("query", self.query)
        blocks = self.blocks
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
            raise TypeError(
                f"blocks must be a sequence of str, got {type(blocks).__name__}: {blocks!r:.80}"
            )
        if len(blocks) > MAX_BLOCKS_PER_REQUEST:
            raise ValueError(
                f"blocks has {len(blocks)} entries; at most {MAX_BLOCKS_PER_REQUEST} per request"
            )
        if not _all_ascii_str(blocks):  # ASCII is UTF-8: the common case needs no check
            for i, text in enumerate(blocks):
                if not isinstance(text, str):
                    raise TypeError(
                        f"blocks[{i}] must be a str, got {type(text).__name__}: {text!r:.80}"
                    )
                _check_utf8(f"blocks[{i}]", text)
        if not isinstance(blocks, tuple):
            object.__setattr__(self, "blocks", tuple(blocks))
        _check_id("rid", self.rid, optional=True)
        if not isinstance(self.scope, Scope):
            raise TypeError(f"scope must be a Scope, got {type(self.scope).__name__}")


def check_batch(requests: object) -> list[PlanRequest]:
    """Check a batch and return it as a list.

    Raises:
        TypeError: ``requests`` is not a sequence of :class:`PlanRequest` (names the index).
        ValueError: a rid given twice, or a conversation twice (its turns are sequential: plan
            them one after the other).
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise TypeError(
            f"requests must be a sequence of PlanRequest, got {type(requests).__name__}"
        )
    rids: dict[str, int] = {}
    conversations: dict[tuple[str, str], int] = {}
    for i, request in enumerate(requests):
        if not isinstance(request, PlanRequest):
            raise TypeError(
                f"requests[{i}] must be a PlanRequest, got {type(request).__name__}: "
                f"{request!r:.80}"
            )
        if request.rid is not None:
            if request.rid in rids:
                raise ValueError(
                    f"requests[{i}].rid {request.rid!r} repeats requests[{rids[request.rid]}]"
                    "; rids must be unique within a batch"
                )
            rids[request.rid] = i
        key = request.scope.conversation
        if key is not None:
            if key in conversations:
                raise ValueError(
                    f"requests[{i}] and requests[{conversations[key]}] are turns of the same "
                    f"conversation {key[1]!r} (tenant {key[0]!r}); plan the turns of one "
                    "conversation one after the other"
                )
            conversations[key] = i
    return list(requests)


def _all_ascii_str(texts: Sequence[object]) -> bool:
    """Whether every one of ``texts`` is an ASCII ``str``, in one pass without a Python step
    per text (docs/DESIGN.md, "Hot path")."""
    try:
        return all(map(str.isascii, texts))  # type: ignore[arg-type]
    except TypeError:  # not a str
        return False


def _check_id(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
    if not value:
        raise ValueError(f"{name} must be a non-empty str (None for none), got ''")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{name} is longer than {MAX_ID_CHARS} characters: {value!r:.80}")
    # Ids are echoed in logs and HTTP headers, where a CR, LF or NUL would forge lines.
    bad = _CONTROL.search(value)
    if bad is not None:
        raise ValueError(
            f"{name} must not contain control characters, got {bad.group()!r} at character "
            f"{bad.start()}: {value!r:.80}"
        )
    _check_utf8(name, value)


def _check_utf8(name: str, text: str) -> None:
    # JSON and Python strings may hold lone surrogates, which cannot be hashed or sent as UTF-8.
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{name} cannot be encoded as UTF-8 ({error.reason} at character {error.start}): "
            f"{text!r:.80}"
        ) from None


NO_SCOPE = Scope()
"""No conversation, the default tenant."""
