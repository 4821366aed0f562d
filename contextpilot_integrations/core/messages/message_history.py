"""What each conversation was sent, message by message, so that its history goes out again
byte for byte (docs/DESIGN.md, "Byte-stable history").

Per ``(tenant, conversation_id)`` the memory holds, for each message sent, a fingerprint of the
message the app gave, a fingerprint of the message sent in its place, the sent message itself
and the placements made for it. A later call's messages are matched against it from the start:
as long as each given message has the fingerprint of what the app gave (or of what was sent:
an app that keeps the sent messages; or of the earlier sent copy it was restored from), the
sent message is replayed. The first message that does
not match is the divergence: from there on everything is new and the records from there are
dropped. A conversation the memory does not hold (never seen, evicted, forgotten) replays
nothing: nothing is ever read from text that might not be there.

An app may give back what was sent and then trim or edit it: a message sent with pointers then
comes back after the divergence, where the texts its pointers name may be gone. The memory
therefore also keeps, per conversation, the records of the messages that went out with pointers
(the last ``max_messages`` of them, dropped records included), found by the fingerprint of what
was sent; :meth:`MessageHistory.restore` gives back the app's original of such a message,
rebuilt from the sent message and its placements (each pointer put back by the exact text it
replaced) and accepted only when it has the fingerprint of what the app gave
(docs/DESIGN.md, "Lossless", "Sure hints").

Each record also keeps what planning derived from its message, so a replayed message is not
read again: the documents found in each of its tool results (:func:`.documents.find_documents`
of the text sent, kept with that text), and whether a later message can be recognised as this
one without validating and fingerprinting it (:func:`prove`): a message that is, node for
node, the sent message or the app's original (both trees of plain JSON types) has the same
canonical JSON, so the same fingerprint, and the same shape, which was validated when the
record was made. The fingerprint of a plain message is computed only when something asks for
it (:data:`LATER`): a conversation whose messages come back as they were needs none.

Bounded (docs/DESIGN.md, "Bounded"): an :class:`~contextpilot_integrations.core.lru.LRU` of at
most ``max_conversations`` conversations, each holding its first ``max_messages`` messages (the
later ones are planned anew on every call, which gives the same messages as long as the
earlier ones are the same: planning is deterministic), and at most ``max_chars`` characters of
sent messages together (:func:`text_size`): a count alone would let a few long conversations
hold any amount of memory. Not thread-safe by itself: the planner
holds its lock around each call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.messages.documents import DocumentRef
from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.message_shapes import (
    Api,
    ToolResult,
    copy_message,
    result_text,
    validate_message,
    with_result_text,
)

__all__ = [
    "LATER",
    "ConversationKey",
    "Later",
    "MessageHistory",
    "Proof",
    "RecordedDocuments",
    "Replay",
    "SentMessage",
    "fingerprint",
    "is_plain",
    "mentions",
    "original_message",
    "prove",
    "same_tree",
    "sent_record",
]

RecordedDocuments = tuple[str, tuple[DocumentRef, ...]]
"""A tool result's text and the labelled documents found in it, as a record keeps them."""

_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))
_NONE = type(None)
_INT_BOUND = 10**18
"""Ints of a plain tree are within this (so short that JSON always writes them, whatever
``sys.set_int_max_str_digits`` allows)."""
_MISSING = object()


class Later:
    """The type of :data:`LATER`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LATER"


LATER = Later()
"""A fingerprint not computed yet: that of a plain message (:func:`is_plain`, so never
``None``), computed when something asks for it; a record keeps its sent message to compute it
from (:meth:`SentMessage.given_fingerprint`)."""

ConversationKey = tuple[str, str]
"""``(tenant, conversation_id)``."""


def fingerprint(message: Any) -> bytes | None:
    """BLAKE2b-128 of the message's canonical JSON (sorted keys, no spaces, UTF-8);
    ``None`` for a message JSON cannot render (it never matches anything)."""
    try:
        # the encoder json.dumps makes for these arguments, made once
        canonical = _CANONICAL.encode(message).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.blake2b(canonical, digest_size=16).digest()


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a tree of plain JSON types: exact dicts with exact str keys, exact
    lists, and exact str, int (below :data:`_INT_BOUND`), float, bool or ``None`` leaves (no
    subclass, no tuple). Such a tree's canonical JSON is a function of its values alone, and
    it always has one (:func:`fingerprint` is never ``None``). Only for a value already
    validated (no cycle, bounded depth: :func:`.message_shapes.validate_message`)."""
    kind = type(value)
    if kind is int:
        return bool(-_INT_BOUND < value < _INT_BOUND)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or (type(item) is not str and not is_plain(item)):
                return False
        return True
    if kind is list:
        return all(type(item) is str or is_plain(item) for item in value)
    return kind is str or kind is float or kind is bool or kind is _NONE


def same_tree(value: Any, plain: Any) -> bool:
    """Whether ``value`` is the :func:`is_plain` tree ``plain`` node for node: the same exact
    types, dict keys exact strs, equal leaves (floats of the same ``repr``, as JSON writes
    them). Then both have the same canonical JSON. ``value`` is read only as deep as
    ``plain`` goes, so any value, a cyclic or deeply nested one included, is safe to give."""
    kind = type(plain)
    if type(value) is not kind:
        return False
    if kind is dict:
        return _same_dict(value, plain)
    if kind is list:
        return _same_list(value, plain)
    return _same_leaf(value, plain, kind)


def _same_dict(value: dict[Any, Any], plain: dict[str, Any]) -> bool:
    if len(value) != len(plain):
        return False
    get = plain.get
    for key, item in value.items():
        if type(key) is not str:
            return False
        other = get(key, _MISSING)
        if type(item) is str:  # the commonest leaf, compared here as same_tree would
            if type(other) is not str or item != other:
                return False
        elif not same_tree(item, other):
            return False
    return True


def _same_list(value: list[Any], plain: list[Any]) -> bool:
    if len(value) != len(plain):
        return False
    for item, other in zip(value, plain):
        if type(item) is str:  # as in _same_dict
            if type(other) is not str or item != other:
                return False
        elif not same_tree(item, other):
            return False
    return True


def _same_leaf(value: Any, plain: Any, kind: type) -> bool:
    """Two leaves both of the exact type ``kind``."""
    if kind is str or kind is int or kind is bool or kind is _NONE:
        return bool(value == plain)
    if kind is float:
        return float.__repr__(value) == float.__repr__(plain)
    return False


def mentions(value: Any, part: str) -> bool:
    """Whether a str of the :func:`is_plain` tree ``value`` (a key or a leaf) holds ``part``."""
    kind = type(value)
    if kind is str:
        return part in value
    if kind is dict:
        return any(part in key or mentions(item, part) for key, item in value.items())
    if kind is list:
        return any(mentions(item, part) for item in value)
    return False


@dataclass(frozen=True, slots=True)
class SentMessage:
    """One message as it was sent.

    Attributes:
        given: fingerprint of the message the app gave; :data:`LATER` for a plain message
            that proves (``proof``) until something asks (:meth:`given_fingerprint`).
        sent_fingerprint: fingerprint of ``sent``; :data:`LATER` for a message sent
            unchanged whose ``given`` is (then it is ``given``'s): read it with
            :meth:`sent_fingerprint_value`.
        sent: the message sent in its place (a private copy, never handed out).
        placements: the placements made for its tool results.
        as_given: fingerprint of the message the app gave when that was a message sent
            before, with pointers, in place of the original ``given`` (:meth:`MessageHistory.
            restore`); it stands for the same original, so it replays too. ``None``: none.
        documents: per tool result of ``sent`` (in order of position), the text it was sent
            with and the labelled documents found in that text (the ones a pointer may name);
            ``None``: not read when it was sent.
        proof: the shape (``api``) for which :func:`prove` may recognise a message as this
            one; ``None``: never (a message that is not a plain tree, one planned from a
            restored original, one whose fingerprint is ``None``).
        aliased: ``sent`` is not the app's message (pointers stand in it), so a message
            given back as it was sent (of fingerprint ``sent_fingerprint``) is found by
            :meth:`MessageHistory.restore`.
        size: :func:`text_size` of ``sent`` (what the record weighs in the memory's bound).
    """

    given: bytes | None | Later
    sent_fingerprint: bytes | None | Later
    sent: dict[str, Any]
    placements: tuple[ResultPlacement, ...]
    as_given: bytes | None = None
    documents: tuple[RecordedDocuments | None, ...] = ()
    proof: Api | None = None
    aliased: bool = False
    size: int = 0

    def given_fingerprint(self) -> bytes | None:
        """``given``, computed (and kept) when it is :data:`LATER`: from ``sent`` when that
        went out unchanged, else from the original rebuilt from it (the two plain trees
        :func:`sent_record` checked to be the app's message)."""
        given = self.given
        if isinstance(given, Later):
            if isinstance(self.sent_fingerprint, Later):
                given = fingerprint(self.sent)
                object.__setattr__(self, "sent_fingerprint", given)
            else:
                given = fingerprint(_with_originals(self.sent, self.placements, copied=False))
            # computed once; the value is the one the record stood for from the start
            object.__setattr__(self, "given", given)
        return given

    def sent_fingerprint_value(self) -> bytes | None:
        """``sent_fingerprint``, computed as :meth:`given_fingerprint` when :data:`LATER`."""
        sent = self.sent_fingerprint
        return self.given_fingerprint() if isinstance(sent, Later) else sent

    def answers(self, given: bytes | None) -> bool:
        """Whether a message of fingerprint ``given`` stands for this one: the app's message,
        the message sent, or the one the app gave in the original's place (``None`` never)."""
        if given is None:
            return False
        if given == self.as_given:
            return True
        return given in (self.given_fingerprint(), self.sent_fingerprint_value())


class Proof:
    """That a message is, node for node, ``record``'s sent message (``as_sent``) or the app's
    original it was sent for (:func:`prove`), so its fingerprint is that record's (made for
    nearly every message of every call: a plain class, cheaper to make than a dataclass)."""

    __slots__ = ("as_sent", "record")

    def __init__(self, record: SentMessage, as_sent: bool) -> None:
        self.record = record
        self.as_sent = as_sent

    def fingerprint(self) -> bytes | None:
        """The message's fingerprint."""
        if self.as_sent:
            return self.record.sent_fingerprint_value()
        return self.record.given_fingerprint()


@dataclass(frozen=True, slots=True)
class Replay:
    """The remembered prefix of one call's messages.

    Attributes:
        sent: the records of the leading messages that match, in order.
        diverged_at: the first index where the given messages stop extending the remembered
            ones; ``None`` when they extend all of them (or nothing is remembered).
    """

    sent: tuple[SentMessage, ...]
    diverged_at: int | None


class MessageHistory:
    """The sent messages of the recent conversations (module docstring: the bounds).

    Raises:
        ValueError: ``max_conversations``, ``max_messages`` or ``max_chars`` not a positive int.
    """

    __slots__ = ("_conversations", "max_messages")

    def __init__(self, max_conversations: int, max_messages: int, max_chars: int) -> None:
        for name, bound in (
            ("max_conversations", max_conversations),
            ("max_messages", max_messages),
            ("max_chars", max_chars),
        ):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{name} must be a positive int, got {bound!r}")
        self.max_messages = max_messages
        # per conversation: its records in order, (sent fingerprint -> record) for the
        # messages sent with pointers, and the records' size together
        self._conversations: LRU[
            ConversationKey, tuple[tuple[SentMessage, ...], dict[bytes, SentMessage], int]
        ] = LRU(max_conversations, max_weight=max_chars, weight=lambda held: held[2])

    def replay(
        self,
        key: ConversationKey | None,
        count: int,
        matches: Callable[[int, SentMessage], bool],
    ) -> Replay:
        """Match a call's ``count`` messages against the conversation: ``matches(i, record)``
        says whether message ``i`` stands for ``record`` (:meth:`SentMessage.answers` of its
        fingerprint), asked in order until one does not."""
        if key is None:
            return Replay((), None)
        held = self._conversations.get(key)
        records = () if held is None else held[0]
        n = 0
        limit = min(len(records), count)
        while n < limit and matches(n, records[n]):
            n += 1
        return Replay(records[:n], n if n < len(records) else None)

    def records(self, key: ConversationKey | None) -> tuple[SentMessage, ...]:
        """The conversation's records, in order (``()`` when none are held); the recency of
        the conversation is left as it is."""
        held = None if key is None else self._conversations.peek(key)
        return () if held is None else held[0]

    def record(self, key: ConversationKey | None, sent: Sequence[SentMessage]) -> None:
        """Remember ``sent`` (every message of the call, in order) as the conversation's
        history, keeping its first ``max_messages``."""
        if key is None:
            return
        kept = tuple(sent[: self.max_messages])
        held = self._conversations.peek(key)
        aliases = {} if held is None else dict(held[1])
        for record in kept:
            if record.aliased:
                assert isinstance(record.sent_fingerprint, bytes)
                aliases.pop(record.sent_fingerprint, None)  # re-inserted as the newest
                aliases[record.sent_fingerprint] = record
        while len(aliases) > self.max_messages:
            del aliases[next(iter(aliases))]
        self._conversations.put(key, (kept, aliases, sum(record.size for record in kept)))

    def has_aliases(self, key: ConversationKey | None) -> bool:
        """Whether the conversation holds a message sent with pointers
        (:meth:`restore` may find something)."""
        held = None if key is None else self._conversations.peek(key)
        return held is not None and bool(held[1])

    def restore(self, key: ConversationKey | None, given: bytes | None) -> dict[str, Any] | None:
        """The app's original of a message of fingerprint ``given`` that is a message this
        conversation was sent with pointers (a new dict); ``None`` when it is none, or when
        the rebuilt original does not have the fingerprint the app's message had."""
        if key is None or given is None:
            return None
        held = self._conversations.peek(key)
        record = None if held is None else held[1].get(given)
        if record is None:
            return None
        original = original_message(record)
        if original is None or fingerprint(original) != record.given_fingerprint():
            return None
        return original

    def forget(self, key: ConversationKey) -> bool:
        """Drop a conversation; False when it was not held."""
        return self._conversations.pop(key) is not None

    def __len__(self) -> int:
        return len(self._conversations)


def prove(message: object, record: SentMessage, api: Api) -> Proof | None:
    """That ``message`` is, node for node (:func:`same_tree`), the message ``record`` was sent
    as or the app's original it was sent for; ``None`` when it is neither, or when ``record``
    proves nothing for ``api``.

    A message so recognised also passes :func:`.message_shapes.validate_message` for ``api``
    without being read: the record's forms are plain trees (:func:`is_plain`) whose shape was
    validated for ``api`` when the record was made, and validation reads nothing of a plain
    tree but its values. Any ``message`` is safe to give (:func:`same_tree`)."""
    if record.proof != api:
        return None
    if same_tree(message, record.sent):
        return Proof(record, as_sent=True)
    if record.aliased:  # sent with pointers: the app's original
        original = _with_originals(record.sent, record.placements, copied=False)
        if original is not None and same_tree(message, original):
            return Proof(record, as_sent=False)
    return None


def original_message(record: SentMessage) -> dict[str, Any] | None:
    """``record``'s sent message with every pointer put back by the text it replaced (a new
    dict); ``None`` when a pointer does not stand where its placement says."""
    return _with_originals(record.sent, record.placements, copied=True)


def _with_originals(
    sent: dict[str, Any], placements: Sequence[ResultPlacement], *, copied: bool
) -> dict[str, Any] | None:
    """:func:`original_message` of ``sent`` and its ``placements``; not ``copied``: the new
    dicts on the way to each result text only, the rest shared with ``sent`` (to be read,
    never handed out)."""
    message = copy_message(sent) if copied else sent
    by_result: dict[int | None, list[ResultPlacement]] = {}
    for placement in placements:
        if placement.status == "pointer":
            by_result.setdefault(placement.block, []).append(placement)
    for block, pointers in by_result.items():
        text = result_text(message, block)
        if text is None:
            return None
        parts: list[str] = []
        position = 0  # in the sent text; the pointers, in order, neither overlap nor move
        for p in sorted(pointers, key=lambda p: -1 if p.offset is None else p.offset):
            if p.pointer is None or p.original is None or p.offset is None:
                return None
            if p.offset < position or not text.startswith(p.pointer, p.offset):
                return None
            parts += (text[position : p.offset], p.original)
            position = p.offset + len(p.pointer)
        parts.append(text[position:])
        text = "".join(parts)  # one join: a result with many pointers is rebuilt in one pass
        slot = ToolResult(pointers[0].message, block, pointers[0].call_id, None)
        message = with_result_text(message, slot, text)
    return message


def sent_record(
    given: bytes | None | Later,
    message: dict[str, Any],
    placements: tuple[ResultPlacement, ...],
    as_given: bytes | None = None,
    *,
    documents: tuple[RecordedDocuments | None, ...] = (),
    plain_given: dict[str, Any] | None = None,
    api: Api | None = None,
) -> SentMessage:
    """The record of ``message`` sent for a given message of fingerprint ``given`` (that the
    app gave as the message of fingerprint ``as_given``, see :class:`SentMessage`); its
    placements are kept marked ``replayed``, as every later call reports them.

    ``documents``: see :class:`SentMessage`. ``plain_given``: the app's message (a copy, an
    :func:`is_plain` tree validated for ``api``, of fingerprint ``given``) when later
    messages may be recognised as this one (:func:`prove`); the record proves ``api`` only
    when its sent message and the original rebuilt from it are checked here to be plain
    trees of the shapes that proof stands on. ``given`` may be :data:`LATER` only with
    ``plain_given``: it stays so when the record proves ``api``, and is computed from
    ``plain_given`` otherwise."""
    unchanged = not any(p.status == "pointer" for p in placements)
    sent = copy_message(message)
    replayed = tuple(_replayed(p) for p in placements)
    proof = None
    original = None
    if plain_given is not None and api is not None and given is not None:
        if unchanged:  # a copy of plain_given itself is that tree node for node
            proven = message is plain_given or same_tree(sent, plain_given)
        else:
            original = _with_originals(sent, replayed, copied=False)
            proven = (
                original is not None
                and same_tree(original, plain_given)
                and is_plain(sent)
                and _validates(sent, api)
            )
        proof = api if proven else None
    if isinstance(given, Later) and proof is None:
        given = fingerprint(plain_given)
    sent_fingerprint = given if unchanged else fingerprint(message)
    if isinstance(given, Later) and not unchanged:
        # Both plain trees: their fingerprints differ exactly where their canonical JSON
        # does, where the trees are not the same node for node.
        aliased = sent_fingerprint is not None and not same_tree(sent, original)
    else:
        aliased = (
            not isinstance(sent_fingerprint, Later)
            and sent_fingerprint is not None
            and sent_fingerprint != given
        )
    return SentMessage(
        given, sent_fingerprint, sent, replayed, as_given, documents, proof, aliased,
        text_size(sent),
    )  # fmt: skip


def text_size(value: Any) -> int:
    """Characters of the strings (dict keys and values) in a JSON-like ``value``, plus one for
    each other leaf and container: what a record weighs in :class:`MessageHistory`'s bound
    (the texts a record keeps beside its message are that message's own strings)."""
    kind = type(value)
    if kind is str:
        return len(value)
    if kind is dict:
        return 1 + sum(
            len(key) + (len(item) if type(item) is str else text_size(item))
            for key, item in value.items()
        )
    if kind is list:
        return 1 + sum(len(item) if type(item) is str else text_size(item) for item in value)
    return 1


def _validates(message: dict[str, Any], api: Api) -> bool:
    try:
        validate_message(0, message, api)
    except ValueError:
        return False
    return True


def _replayed(p: ResultPlacement) -> ResultPlacement:
    """``p`` marked ``replayed`` (``dataclasses.replace(p, replayed=True)``)."""
    return ResultPlacement(
        p.message,
        p.block,
        p.call_id,
        p.document,
        p.label,
        p.status,
        True,
        p.reason,
        p.target_message,
        p.target_block,
        p.target_document,
        p.target_label,
        p.target_call,
        p.original,
        p.pointer,
        p.offset,
        p.tokens_saved,
    )
