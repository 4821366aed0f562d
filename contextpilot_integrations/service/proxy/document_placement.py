"""Retrieved documents a client marks in the body, planned by the tenant's context index and put
in front of its newest user message (docs/DESIGN.md, "The proxy").

The body extension ``contextpilot.documents`` is a list of strings, the retrieved blocks of the
call in relevance order (best first); ``contextpilot.query`` optionally the question they were
retrieved for (default: the text of the newest user message). :func:`read_documents` checks
them; :class:`DocumentPlacer` plans them with ``ContextPilot.plan`` (aligned with the
tenant's other requests into a common prefix, de-duplicated within the conversation, with the
order annotation) and puts ``Plan.context`` (the blocks in planned order, the location hints,
the annotation; what every face shows the model) in front of the newest user message:

- OpenAI: a str content becomes ``context + "\\n\\n" + content``; a list of parts gets a text
  part holding the context first;
- Anthropic: the same for the last ``user`` message that is not only ``tool_result`` blocks
  (a text block after its leading ``tool_result`` blocks, which the API wants first).

That message must be new: one followed by an assistant (or tool) message was sent before, and
nothing before the first new message may change (422 naming ``contextpilot.documents``).

**Byte-stable history.** The app keeps the user message as it wrote it, without the documents;
the engine saw it with them. On later calls of the conversation :class:`DocumentMemory` puts the
message as sent back in its place before the message planner reads the messages, so the
earlier prompt stays a byte-identical prefix of the next (and the planner's replay, which
compares the given messages with what it recorded, sees the same message every time). A message
is found by a digest of the messages up to and including it as the app sent them: the same
words at another point of the conversation (a second "continue") are another message, and a
history the app edited or trimmed before it finds nothing from there on (the prefix is lost
there anyway). A conversation without a named id (the opening-hash key, which two
conversations may share) has no memory: its documents are placed for that call only.

**Turns and hints.** The documents of the ``n``-th user turn (user messages that are not only
tool results, counted from 1) are planned as turn ``n`` of the conversation, and only the
earlier turns whose message as sent stands at its place in this very request are visible to
de-duplication, so a hint ``[Doc 2] of turn 1`` names text the request holds. Every document
given is then checked on the rendered context (:func:`_context_keeps_everything`): shown,
standing for an identical input, or replaced by a hint whose text the request holds; a plan
that fails the check goes out with every document in full.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import PlacementStatus, Plan
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.core.window.planning_window import PlanningWindow

__all__ = [
    "DOCUMENTS_FIELD",
    "MAX_DOCUMENTS",
    "MAX_DOCUMENTS_CHARS",
    "DocumentError",
    "DocumentMemory",
    "DocumentPlacer",
    "DocumentRequest",
    "PlacedDocuments",
    "read_documents",
]

logger = logging.getLogger(__name__)

DOCUMENTS_FIELD = "contextpilot.documents"
"""The field named in errors about the documents."""

MAX_DOCUMENTS = 256
"""Most documents in one call (a retriever's top-k)."""

MAX_DOCUMENTS_CHARS = 4_000_000
"""Most characters of one call's documents together: beyond any model's context window."""


class DocumentError(ValueError):
    """Documents the proxy refuses; ``field`` is the field at fault."""

    def __init__(self, message: str, field: str = DOCUMENTS_FIELD) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class DocumentRequest:
    """What the extension asks: the documents (relevance order) and the question (``None``:
    the newest user message's text)."""

    documents: tuple[str, ...]
    query: str | None


def read_documents(extension: Mapping[str, Any]) -> DocumentRequest | None:
    """The extension's ``documents`` and ``query``; ``None`` when no documents are given.

    Raises:
        DocumentError: ``documents`` not a list of non-empty str (without lone surrogates),
            more than :data:`MAX_DOCUMENTS` or :data:`MAX_DOCUMENTS_CHARS` in total, or a
            ``query`` without ``documents`` or that is not a str (the field and value named).
    """
    documents = extension.get("documents")
    query = extension.get("query")
    if documents is None:
        if query is not None:
            raise DocumentError(
                "contextpilot.query is only read with contextpilot.documents, which is missing",
                "contextpilot.query",
            )
        return None
    if not isinstance(documents, list):
        raise DocumentError(
            f"{DOCUMENTS_FIELD} must be a list of str, got {type(documents).__name__}: "
            f"{documents!r:.80}"
        )
    if not documents:
        raise DocumentError(f"{DOCUMENTS_FIELD} must hold at least one document, got []")
    if len(documents) > MAX_DOCUMENTS:
        raise DocumentError(
            f"{DOCUMENTS_FIELD} has {len(documents)} documents; at most {MAX_DOCUMENTS} per call"
        )
    total = 0
    for i, text in enumerate(documents):
        field = f"{DOCUMENTS_FIELD}[{i}]"
        if not isinstance(text, str):
            raise DocumentError(
                f"{field} must be a str, got {type(text).__name__}: {text!r:.80}", field
            )
        if not text.strip():
            raise DocumentError(f"{field} must hold text, got {text!r:.80}", field)
        _check_text(field, text)
        total += len(text)
    if total > MAX_DOCUMENTS_CHARS:
        raise DocumentError(
            f"{DOCUMENTS_FIELD} holds {total} characters; at most {MAX_DOCUMENTS_CHARS} per call"
        )
    if query is not None:
        if not isinstance(query, str):
            raise DocumentError(
                f"contextpilot.query must be a str, got {type(query).__name__}: {query!r:.80}",
                "contextpilot.query",
            )
        _check_text("contextpilot.query", query)
    return DocumentRequest(tuple(documents), query)


def _check_text(field: str, text: str) -> None:
    """Refuse a lone surrogate (JSON can carry one; no tokenizer reads it)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DocumentError(
                f"{field} must be Unicode text (a lone surrogate at character {exc.start})", field
            ) from None


@dataclass(frozen=True, slots=True)
class _Sent:
    """A user message as sent with documents: a private copy (never changed), its encoded
    size in bytes (the memory's weight) and the turn its documents were planned as."""

    message: dict[str, Any]
    size: int
    turn: int


@dataclass(frozen=True, slots=True)
class _Held:
    """One conversation's sent messages by chain digest, and their bytes when last put (the
    weight the tenant's bound reads; a new value each put, so the LRU's total stays right)."""

    entries: LRU[bytes, _Sent | None]
    size: int


def _weight(sent: _Sent | None) -> int:
    """A kept entry's weight in bytes (an ambiguous chain's marker weighs nothing)."""
    return 0 if sent is None else sent.size


class DocumentMemory:
    """One tenant's user messages as sent with documents, per conversation (module docstring).

    Args:
        max_conversations: conversations kept (least recently used dropped first).
        max_messages: messages kept per conversation (its oldest used dropped first).
        max_bytes: encoded bytes of every kept message together (least recently used
            conversations dropped first; one heavier than the bound is kept alone).

    Thread-safe (one lock).
    """

    def __init__(
        self,
        *,
        max_conversations: int = 10_000,
        max_messages: int = 256,
        max_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self.max_messages = max_messages
        self._conversations: LRU[str, _Held] = LRU(
            max_conversations, max_weight=max_bytes, weight=lambda held: held.size
        )
        self._lock = threading.Lock()

    def holds(self, conversation: str) -> bool:
        """Whether ``conversation`` has any message kept."""
        with self._lock:
            return conversation in self._conversations

    def lookup(self, conversation: str, chain: bytes) -> _Sent | None:
        """The message sent for the one whose chain digest is ``chain``, or ``None`` (none
        kept, or two different ones: see :meth:`put`)."""
        with self._lock:
            held = self._conversations.get(conversation)
            return None if held is None else held.entries.get(chain)

    def put(self, conversation: str, chain: bytes, sent: _Sent) -> None:
        """Keep ``sent`` for the message whose chain digest is ``chain``.

        A second, different message for the same chain (two chats under one conversation id
        that open alike, or a retry with other documents) makes the chain ambiguous for good:
        nothing is put back for it, since the proxy cannot tell which of the two the app's
        history continues, and one chat's documents must never stand in the other's history.
        """
        with self._lock:
            held = self._conversations.get(conversation)
            entries = held.entries if held is not None else LRU(self.max_messages)
            size = held.size if held is not None else 0
            kept: _Sent | None = sent
            if chain in entries:
                old = entries.peek(chain)
                if old is None or old.message != sent.message:
                    kept = None
                if old is not None:
                    size -= old.size
            size += _weight(kept)
            for _, evicted in entries.put(chain, kept):
                size -= _weight(evicted)
            # One conversation heavier than the tenant's bound keeps its newest messages only
            # (an earlier turn not put back is not visible: no hint names it).
            bound = self._conversations.max_weight
            while bound is not None and size > bound and len(entries) > 1:
                _, evicted = entries.pop_oldest()
                size -= _weight(evicted)
            self._conversations.put(conversation, _Held(entries, size))

    def __len__(self) -> int:
        with self._lock:
            return len(self._conversations)


@dataclass(frozen=True, slots=True)
class _Places:
    """What a hint or pointer may name: ``hints`` maps a whole-block hint to the label and the
    message text it names; ``blocks`` a place (``"[Doc 2] of turn 1"``) to its block's text."""

    hints: dict[str, tuple[str, str]]
    blocks: dict[str, str]


@dataclass(frozen=True)
class PlacedDocuments:
    """The documents of one call, planned and placed.

    Attributes:
        messages: the messages to plan (earlier sent-with-documents messages put back, the
            newest user message with the context in front); a new list, the given one is
            unchanged.
        plan: the pilot's plan of the documents.
        target: index of the user message the context went into.
        in_full: whether the check failed and every document went out in full instead.
        substituted: earlier messages put back as they were sent.
    """

    messages: list[dict[str, Any]]
    plan: Plan
    target: int
    in_full: bool
    substituted: int
    _record: tuple[str, bytes, _Sent] | None = None

    @property
    def reordered(self) -> bool:
        """Whether the shown documents stand in another order than the client's."""
        order = self.plan.order
        return not self.in_full and order != sorted(order)

    @property
    def shown(self) -> int:
        """Documents the context shows in full (identical inputs once)."""
        if self.in_full:
            return sum(1 for p in self.plan.placements if p.status is not PlacementStatus.DUPLICATE)
        return len(self.plan.blocks)

    @property
    def replaced(self) -> int:
        """Documents replaced by a hint to where their text stands in the request."""
        return 0 if self.in_full else self.plan.dedup_figures.blocks_replaced

    @property
    def tokens_removed(self) -> int:
        """Tokens the hints and pointers saved (the pilot's counter; 0 when sent in full,
        though the pilot's totals keep the figures of the plan it made)."""
        return 0 if self.in_full else self.plan.dedup_figures.tokens_saved


class DocumentPlacer:
    """Places documents for one tenant (its pilot, or its replica router behind a fleet,
    either behind a planning window that plans calls arriving together as one batch, and its
    :class:`DocumentMemory`)."""

    def __init__(
        self, pilot: ContextPilot | ReplicaRouter | PlanningWindow, memory: DocumentMemory
    ) -> None:
        self.pilot = pilot
        self.memory = memory
        owner = pilot.planner if isinstance(pilot, PlanningWindow) else pilot
        if not isinstance(owner, (ContextPilot, ReplicaRouter)):
            raise TypeError(
                f"pilot must be a ContextPilot or ReplicaRouter (or a PlanningWindow in front "
                f"of one), got {type(owner).__name__}"
            )
        self._wording = owner.deduplicator.wording

    def restore(
        self,
        messages: Sequence[Any],
        api: str,
        conversation: str | None,
        system: object = None,
        *,
        before: int | None = None,
    ) -> tuple[list[Any], frozenset[int], int]:
        """``messages`` with every earlier sent-with-documents message put back: those the
        app's history holds, before its last assistant message (and before index ``before``).
        A newest user message is the app's new call, never one to add documents to unasked.

        Returns:
            ``(messages, visible turns, messages put back)``; the list is new, the messages
            themselves are shared (the planner never changes its input).
        """
        out = list(messages)
        if conversation is None or not self.memory.holds(conversation):
            return out, frozenset(), 0
        end = next(
            (i for i in range(len(messages) - 1, -1, -1) if _role(messages[i]) == "assistant"), 0
        )
        if before is not None:
            end = min(end, before)
        visible: set[int] = set()
        put_back = 0
        turn = 0
        for i, chain in enumerate(_chain(messages[:end], system)):
            message = messages[i]
            if not _is_user_turn(message, api):
                continue
            turn += 1
            sent = self.memory.lookup(conversation, chain)
            if sent is not None and sent.turn == turn:
                out[i] = sent.message
                visible.add(turn)
                put_back += 1
        return out, frozenset(visible), put_back

    def place(
        self,
        request: DocumentRequest,
        messages: Sequence[Any],
        api: str,
        *,
        rid: str,
        scope: Scope,
        remember: bool,
        system: object = None,
    ) -> PlacedDocuments:
        """Plan ``request``'s documents and put them in front of the newest user message.

        Args:
            request: the documents and the question.
            messages: the messages as the app gave them (already checked by the planner's
                shape rules).
            api: ``"openai"`` or ``"anthropic"``.
            rid: the call's engine rid (the index entry and the engine's events name it).
            scope: the conversation (``turn`` and ``visibility`` are set here).
            remember: keep the message as sent for the conversation's later calls.
            system: Anthropic's system prompt (part of what finds a message again).

        Raises:
            DocumentError: no user message, or the newest one was sent before.
        """
        target = _target(messages, api)
        conversation = scope.conversation_id if remember else None
        restored, visible, put_back = self.restore(
            messages, api, conversation, system, before=target
        )
        turn = sum(1 for m in messages[: target + 1] if _is_user_turn(m, api))
        original = messages[target]
        query = request.query if request.query is not None else _text_of(original)
        plan_scope = Scope(
            conversation_id=scope.conversation_id,
            tenant=scope.tenant,
            turn=turn if scope.conversation_id is not None else None,
            visibility=(
                TurnVisibility.only(visible) if scope.conversation_id is not None else None
            ),
        )
        plan = self.pilot.plan(query, request.documents, rid=rid, scope=plan_scope)
        context = plan.context
        # What the request holds of earlier turns' documents: the messages put back.
        earlier = "".join(
            _text_of(restored[i]) for i in range(target) if restored[i] is not messages[i]
        )
        # Each visible turn's message as sent, by turn number: a hint must name a block that
        # holds the document's text in the message of the turn it names (the conversation
        # store's record of a turn may come from another branch of the conversation).
        sent_turns: dict[int, str] = {}
        number = 0
        for i in range(target):
            if _is_user_turn(messages[i], api):
                number += 1
                if restored[i] is not messages[i]:
                    sent_turns[number] = _text_of(restored[i])
        in_full = not _context_keeps_everything(
            plan, context, earlier, self._hint_places(plan, context, sent_turns, turn)
        )
        if in_full:
            logger.warning(
                "documents of %s: the plan's context does not show every document or a hint "
                "to text the request holds; sending every document in full",
                rid,
            )
            context = _in_full(plan)
        placed = _with_context(original, context, api)
        restored[target] = placed
        record = None
        # A turn sent in full instead of as planned is never put back: the conversation
        # store's records (labels, places) are the plan's, so no later hint may name it.
        if conversation is not None and plan.scope.turn is not None and not in_full:
            chain = _chain(messages[: target + 1], system)[-1]
            record = (conversation, chain, _Sent(placed, _size(placed), turn))
        return PlacedDocuments(restored, plan, target, in_full, put_back, record)

    def _hint_places(
        self, plan: Plan, context: str, sent_turns: Mapping[int, str], turn: int
    ) -> _Places:
        """Where each hint or pointer the plan may show names a block: an earlier turn's
        message as sent, or this call's context, which must hold the block under the label."""
        wording = self._wording
        layout = plan.layout
        head, _, _ = layout.block_template.partition("{text}")
        places = _Places({}, {})
        for number, text in (*sent_turns.items(), (turn, context)):
            for p in range(MAX_DOCUMENTS):
                label = layout.label(p)
                start = text.find(head.format(label=label))
                if start < 0:
                    break
                where = (
                    wording.this_turn.format(label=label)
                    if number == turn
                    else wording.earlier_turn.format(label=label, turn=number)
                )
                hint = wording.block_hint.format(where=where, label=label, turn=number)
                places.hints.setdefault(hint, (label, text))
                body = text[start + len(head.format(label=label)) :]
                end = body.find(layout.block_separator)
                places.blocks.setdefault(where, body if end < 0 else body[:end])
        return places

    def commit(self, placed: PlacedDocuments) -> None:
        """Keep the placed message for the conversation's later calls (once the call is
        prepared: a refused call leaves nothing)."""
        if placed._record is not None:
            self.memory.put(*placed._record)


def _canonical(value: object) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces, UTF-8; lone surrogates kept)."""
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        # Not JSON (never recorded: a recorded message passed the planner's shape rules), so
        # bytes no JSON text has: it matches nothing that was recorded.
        return b"\x00"
    return text.encode("utf-8", "surrogatepass")


def _chain(messages: Sequence[Any], system: object) -> list[bytes]:
    """Per message, a BLAKE2b-128 digest of the system prompt and every message up to and
    including it (what finds a message again at its place in the conversation)."""
    digest = hashlib.blake2b(b"system\x00" + _canonical(system), digest_size=16).digest()
    out = []
    for message in messages:
        digest = hashlib.blake2b(digest + _canonical(message), digest_size=16).digest()
        out.append(digest)
    return out


def _is_user_turn(message: object, api: str) -> bool:
    """A user message that is a turn: OpenAI's ``user``; Anthropic's ``user`` that is not only
    ``tool_result`` blocks."""
    if not isinstance(message, Mapping) or message.get("role") != "user":
        return False
    if api != "anthropic":
        return True
    content = message.get("content")
    if isinstance(content, list) and content:
        return not all(
            isinstance(block, Mapping) and block.get("type") == "tool_result" for block in content
        )
    return True


def _target(messages: Sequence[Any], api: str) -> int:
    """Index of the newest user turn, which must be new (module docstring).

    Raises:
        DocumentError: there is none, or an assistant or tool message follows it.
    """
    for i in range(len(messages) - 1, -1, -1):
        if _is_user_turn(messages[i], api):
            break
    else:
        raise DocumentError(
            f"{DOCUMENTS_FIELD} needs a user message to go in; messages has none"
            + (" (only tool results)" if api == "anthropic" else "")
        )
    for j in range(i + 1, len(messages)):
        role = _role(messages[j])
        if role in ("assistant", "tool"):
            raise DocumentError(
                f"{DOCUMENTS_FIELD} go in front of the newest user message, messages[{i}], but "
                f"messages[{j}] ({role}) follows it: it was sent before, and the history is "
                "never changed; send documents with a new user message"
            )
    return i


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, Mapping) else None


def _text_of(message: object) -> str:
    """The text of a message: a str content, or its text parts joined by newlines."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def _with_context(message: Mapping[str, Any], context: str, api: str) -> dict[str, Any]:
    """A new ``message`` with ``context`` in front of its content (module docstring)."""
    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = context + "\n\n" + content
        return out
    parts = list(content) if isinstance(content, list) else []
    at = 0
    if api == "anthropic":
        while (
            at < len(parts)
            and isinstance(parts[at], Mapping)
            and parts[at].get("type") == "tool_result"
        ):
            at += 1
    parts.insert(at, {"type": "text", "text": context})
    out["content"] = parts
    return out


def _context_keeps_everything(
    plan: Plan,
    context: str,
    earlier: str,
    places: _Places | None = None,
) -> bool:
    """Whether every document stands in ``context`` (``plan.context``) as a block, stands for
    an identical input, or is replaced by a hint that ``context`` shows while every line of its
    text stands in ``earlier`` (the earlier turns' messages put back) or ``context``; a block
    with sub-block pointers must have every line of its text there too. Lines are compared as
    a set, so the check is linear in the texts (a block stands in a prompt as whole lines:
    the layout puts its label and separator on lines of their own)."""
    layout = plan.layout
    segments = plan.segments
    hints = set(plan.hints)
    lines: set[str] | None = None
    for placement in plan.placements:
        status = placement.status
        if status is PlacementStatus.DUPLICATE:
            if placement.duplicate_of is None:
                return False
            continue
        if status is PlacementStatus.SHOWN:
            position, rendered = placement.position, placement.rendered_text
            if (
                position is None
                or rendered is None
                or position + 1 >= len(segments)
                or segments[position + 1] != layout.render_block(position, rendered)
            ):
                return False
            if rendered == placement.text:
                continue
            if places is not None and not _pointers_name_their_text(
                placement.text, rendered, places
            ):
                return False
        elif status is PlacementStatus.REPLACED:
            if placement.hint is None or placement.hint not in hints:
                return False
            if places is not None:
                # The hint names a block of one message: that block must be this text.
                named = places.hints.get(placement.hint)
                if named is None:
                    return False
                label, where = named
                if plan.layout.block_template.format(label=label, text=placement.text) not in where:
                    return False
        else:  # skipped: refused before planning; never silently dropped
            return False
        if lines is None:
            lines = set(context.splitlines()) | set(earlier.splitlines())
        if not all(line in lines for line in placement.text.splitlines()):
            return False
    return True


def _pointers_name_their_text(text: str, rendered: str, places: _Places) -> bool:
    """Whether every line a block's sub-block pointers replaced stands in a block the
    pointers name (a place the rendered text names and the text does not)."""
    named = [
        block for where, block in places.blocks.items() if where in rendered and where not in text
    ]
    if not named:
        return False
    shown = set(rendered.splitlines())
    there = set().union(*(block.splitlines() for block in named))
    return all(line in there for line in text.splitlines() if line not in shown)


def _in_full(plan: Plan) -> str:
    """Every distinct document in full, in the client's order (so no annotation), no hints."""
    layout = plan.layout
    texts = [p.text for p in plan.placements if p.status is not PlacementStatus.DUPLICATE]
    return "".join(layout.render_block(i, text) for i, text in enumerate(texts))


def _size(message: object) -> int:
    return len(_canonical(message))
