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

Bounded (docs/DESIGN.md, "Bounded"): an :class:`~contextpilot_integrations.core.lru.LRU` of at
most ``max_conversations`` conversations, each holding its first ``max_messages`` messages (the
later ones are planned anew on every call, which gives the same messages as long as the
earlier ones are the same: planning is deterministic). Not thread-safe by itself: the planner
holds its lock around each call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.message_shapes import (
    ToolResult,
    copy_message,
    result_text,
    with_result_text,
)

__all__ = [
    "ConversationKey",
    "MessageHistory",
    "Replay",
    "SentMessage",
    "fingerprint",
    "original_message",
    "sent_record",
]

ConversationKey = tuple[str, str]
"""``(tenant, conversation_id)``."""


def fingerprint(message: Any) -> bytes | None:
    """BLAKE2b-128 of the message's canonical JSON (sorted keys, no spaces, UTF-8);
    ``None`` for a message JSON cannot render (it never matches anything)."""
    try:
        canonical = json.dumps(
            message, sort_keys=True, ensure_ascii=False, separators=(",", ":")
        ).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.blake2b(canonical, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class SentMessage:
    """One message as it was sent.

    Attributes:
        given: fingerprint of the message the app gave.
        sent_fingerprint: fingerprint of ``sent``.
        sent: the message sent in its place (a private copy, never handed out).
        placements: the placements made for its tool results.
        as_given: fingerprint of the message the app gave when that was a message sent
            before, with pointers, in place of the original ``given`` (:meth:`MessageHistory.
            restore`); it stands for the same original, so it replays too. ``None``: none.
    """

    given: bytes | None
    sent_fingerprint: bytes | None
    sent: dict[str, Any]
    placements: tuple[ResultPlacement, ...]
    as_given: bytes | None = None


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
    """The sent messages of the recent conversations.

    Raises:
        ValueError: ``max_conversations`` or ``max_messages`` not a positive int.
    """

    __slots__ = ("_conversations", "max_messages")

    def __init__(self, max_conversations: int, max_messages: int) -> None:
        for name, bound in (
            ("max_conversations", max_conversations),
            ("max_messages", max_messages),
        ):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{name} must be a positive int, got {bound!r}")
        self.max_messages = max_messages
        # per conversation: its records in order, and (sent fingerprint -> record) for the
        # messages sent with pointers
        self._conversations: LRU[
            ConversationKey, tuple[tuple[SentMessage, ...], dict[bytes, SentMessage]]
        ] = LRU(max_conversations)

    def replay(self, key: ConversationKey | None, given: Sequence[bytes | None]) -> Replay:
        """Match the fingerprints ``given`` of a call's messages against the conversation."""
        if key is None:
            return Replay((), None)
        held = self._conversations.get(key)
        records = () if held is None else held[0]
        n = 0
        limit = min(len(records), len(given))
        while n < limit:
            fp = given[n]
            record = records[n]
            if fp is None or fp not in (record.given, record.sent_fingerprint, record.as_given):
                break
            n += 1
        return Replay(records[:n], n if n < len(records) else None)

    def record(self, key: ConversationKey | None, sent: Sequence[SentMessage]) -> None:
        """Remember ``sent`` (every message of the call, in order) as the conversation's
        history, keeping its first ``max_messages``."""
        if key is None:
            return
        kept = tuple(sent[: self.max_messages])
        held = self._conversations.peek(key)
        aliases = {} if held is None else dict(held[1])
        for record in kept:
            if record.sent_fingerprint is not None and record.sent_fingerprint != record.given:
                aliases.pop(record.sent_fingerprint, None)  # re-inserted as the newest
                aliases[record.sent_fingerprint] = record
        while len(aliases) > self.max_messages:
            del aliases[next(iter(aliases))]
        self._conversations.put(key, (kept, aliases))

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
        if original is None or fingerprint(original) != record.given:
            return None
        return original

    def forget(self, key: ConversationKey) -> bool:
        """Drop a conversation; False when it was not held."""
        return self._conversations.pop(key) is not None

    def __len__(self) -> int:
        return len(self._conversations)


def original_message(record: SentMessage) -> dict[str, Any] | None:
    """``record``'s sent message with every pointer put back by the text it replaced (a new
    dict); ``None`` when a pointer does not stand where its placement says."""
    message = copy_message(record.sent)
    by_result: dict[int | None, list[ResultPlacement]] = {}
    for placement in record.placements:
        if placement.status == "pointer":
            by_result.setdefault(placement.block, []).append(placement)
    for block, pointers in by_result.items():
        text = result_text(message, block)
        if text is None:
            return None
        for p in sorted(pointers, key=lambda p: -1 if p.offset is None else p.offset, reverse=True):
            if p.pointer is None or p.original is None or p.offset is None:
                return None
            if not text.startswith(p.pointer, p.offset):
                return None
            text = text[: p.offset] + p.original + text[p.offset + len(p.pointer) :]
        slot = ToolResult(pointers[0].message, block, pointers[0].call_id, None)
        message = with_result_text(message, slot, text)
    return message


def sent_record(
    given: bytes | None,
    message: dict[str, Any],
    placements: tuple[ResultPlacement, ...],
    as_given: bytes | None = None,
) -> SentMessage:
    """The record of ``message`` sent for a given message of fingerprint ``given`` (that the
    app gave as the message of fingerprint ``as_given``, see :class:`SentMessage`); its
    placements are kept marked ``replayed``, as every later call reports them."""
    unchanged = not any(p.status == "pointer" for p in placements)
    sent = given if unchanged else fingerprint(message)
    return SentMessage(
        given,
        sent,
        copy_message(message),
        tuple(replace(p, replayed=True) for p in placements),
        as_given,
    )
