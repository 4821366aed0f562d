"""Per-conversation memory of what earlier prompts showed the model, recorded only once sent.

Multi-turn de-duplication (:mod:`.dedup`) replaces a block that an earlier turn of the same
conversation already sent by a hint naming where it stands. That needs, per conversation, the
blocks and sub-blocks each turn rendered in full and their place (turn number, label, sub-block
index). :class:`ConversationStore` keeps it:

- keyed by ``(tenant, conversation_id)``; a ``None`` conversation id is never stored or matched
  (docs/DESIGN.md, "Isolation");
- two-phase: :meth:`ConversationStore.open_turn` reserves the turn's number and yields a
  :class:`~.conversation_turn.ConversationTurn` for its lookups; its records enter the history
  only on :meth:`~.conversation_turn.ConversationTurn.commit`, once the plan is returned (a
  plan or batch that fails records nothing);
- bounded (docs/DESIGN.md, "Bounded"): at most ``max_conversations`` (LRU), ``ttl_seconds``
  unused, ``max_turns`` per conversation (oldest dropped first); thread-safe: one lock.

:class:`~.turns.TurnVisibility` says which earlier turns the app's prompt still holds. Turn
numbers never go silently wrong (docs/DESIGN.md, "Sure hints"): numbers the app gives
(``turn=``) are its own; numbers the store assigns continue after a dropped conversation (its
*tombstone* keeps the latest number); a store that may have missed turns (restored from a
checkpoint, told history was lost, tombstones overflowed) is *amnesic* and numbers no turn
itself (``scope.turn`` is ``None``, nothing recorded) until the app gives its own number. A
store restored from a checkpoint keeps only each conversation's latest number; a *final*
snapshot (taken when planning has stopped) restores everything.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from contextpilot_integrations.core.conversations.conversation_records import (
    ConversationRecords,
    Record,
    nonnegative_int,
)
from contextpilot_integrations.core.conversations.conversation_turn import ConversationTurn
from contextpilot_integrations.core.conversations.turns import MAX_TURN, TurnVisibility, next_turn
from contextpilot_integrations.core.lru import LRU

__all__ = ["CONVERSATION_SNAPSHOT_VERSION", "ConversationStore"]

CONVERSATION_SNAPSHOT_VERSION = 1
"""Version of :meth:`ConversationStore.snapshot`'s format."""

_ALL_TURNS = TurnVisibility()


class ConversationStore:
    """Bounded, thread-safe store of the blocks each conversation's earlier turns sent.

    Args:
        max_conversations: most conversations kept; the least recently used is evicted first.
        ttl_seconds: a conversation unused for this long (seconds, by ``clock``) expires;
            ``None`` for no time limit.
        max_turns: most turns kept per conversation; the oldest turn's records are dropped
            first (hints never point to a dropped turn).
        max_tombstones: dropped conversations whose latest turn number is remembered (LRU);
            when one is forgotten, the store becomes amnesic (module docstring).
        clock: monotonic time source in seconds (injectable for tests).

    Raises:
        TypeError: a bound is not a number of the right kind.
        ValueError: ``max_conversations < 1``, ``max_turns < 1``, ``max_tombstones < 1`` or
            ``ttl_seconds <= 0``.
    """

    def __init__(
        self,
        *,
        max_conversations: int = 10_000,
        ttl_seconds: float | None = 3600.0,
        max_turns: int = 256,
        max_tombstones: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_conversations", max_conversations),
            ("max_turns", max_turns),
            ("max_tombstones", max_tombstones),
        ):
            _check_int(name, value)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if ttl_seconds is not None:
            if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, (int, float)):
                raise TypeError(f"ttl_seconds must be a number or None, got {ttl_seconds!r}")
            if not ttl_seconds > 0:
                raise ValueError(f"ttl_seconds must be > 0 or None, got {ttl_seconds!r}")
        self.max_conversations = max_conversations
        self.ttl_seconds = None if ttl_seconds is None else float(ttl_seconds)
        self.max_turns = max_turns
        self._clock = clock
        self._lock = threading.Lock()
        # least recently used first
        self._conversations: LRU[tuple[str, str], ConversationRecords] = LRU(max_conversations)
        # dropped conversation -> (latest turn number, continuous)
        self._tombstones: LRU[tuple[str, str], tuple[int, bool]] = LRU(max_tombstones)
        self._amnesic = False
        self._counters = {"evicted": 0, "expired": 0, "aborted": 0, "unnumbered": 0}

    # ------------------------------------------------------------------ Public API
    @contextmanager
    def open_turn(
        self,
        tenant: str,
        conversation_id: str,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Iterator[ConversationTurn]:
        """Hold the store for planning one turn of a conversation; the turn stays pending.

        Creates the conversation if needed and marks it used. Planning a turn number that is
        not after the conversation's latest turn (a retry, or an edited history) first drops
        the records of that turn and every later one. The caller commits the yielded turn once
        its plan is handed out, or aborts it; if the block raises, the turn is aborted.

        Args:
            tenant: the tenant (``""`` for a single-tenant app).
            conversation_id: the conversation; must be a non-empty ``str`` (callers skip the
                store when a request has no conversation).
            turn: this turn's number (``int >= 0``, the app's own); ``None`` for one after the
                latest turn the store knows (``1`` in a new conversation).
            visibility: the earlier turns the app's prompt still holds; ``None`` for all.

        Yields:
            The :class:`ConversationTurn` to look up and record with (the store's lock is held
            until the block ends; keep the work inside short).

        Raises:
            TypeError / ValueError: bad ``tenant``, ``conversation_id``, ``turn`` or
                ``visibility`` (the message names the field and value); no ``turn`` while
                the latest is :data:`MAX_TURN` (:func:`next_turn`).
        """
        key = _conversation_key(tenant, conversation_id)
        if turn is not None:
            _check_int("turn", turn)
            if not 0 <= turn <= MAX_TURN:
                raise ValueError(f"turn must be in 0..{MAX_TURN}, got {turn}")
        if visibility is None:
            visibility = _ALL_TURNS
        elif not isinstance(visibility, TurnVisibility):
            raise TypeError(
                f"visibility must be a TurnVisibility or None, got {type(visibility).__name__}"
            )
        with self._lock:
            now = self._clock()
            self._expire(now)
            conversation = self._conversations.get(key)
            if conversation is None:
                conversation = self._create(key, now)
            conversation.last_used = now
            latest = conversation.latest_turn()
            if turn is None:
                if conversation.continuous:
                    turn = next_turn(conversation_id, latest)
                else:
                    self._counters["unnumbered"] += 1
            else:
                if latest is not None and turn <= latest:
                    conversation.drop_turns_from(turn)
                conversation.continuous = True  # from now on the store counts on from the app's
            if turn is not None:
                conversation.pending.add(turn)
            handle = ConversationTurn(
                conversation,
                key,
                turn,
                visibility,
                on_commit=functools.partial(self._commit, conversation, turn),
                on_abort=functools.partial(self._abort, conversation, turn),
            )
            try:
                yield handle
            except BaseException:
                if turn is not None:
                    conversation.pending.discard(turn)  # the lock is held: no handle.abort()
                self._counters["aborted"] += 1
                handle.close(failed=True)
                raise
            handle.close(failed=False)

    def forget(self, tenant: str, conversation_id: str) -> bool:
        """Drop a conversation's records (the user deleted it). ``False`` if unknown. Its
        turn numbers are remembered (a tombstone), so a conversation reusing the id never
        reuses a number."""
        key = _conversation_key(tenant, conversation_id)
        with self._lock:
            conversation = self._conversations.pop(key)
            if conversation is None:
                return False
            self._bury(key, conversation)
            return True

    def mark_history_lost(self) -> None:
        """The owner knows turns may have been planned that this store never recorded (a
        snapshot that could not be read): from now on the store numbers no turn of a
        conversation until the app gives its own number (module docstring)."""
        with self._lock:
            self._amnesic = True
            for conversation in self._conversations.values():
                conversation.continuous = False

    def __contains__(self, key: object) -> bool:
        """``(tenant, conversation_id) in store``: the conversation is held and not expired."""
        with self._lock:
            self._expire(self._clock())
            return key in self._conversations

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._conversations)

    def stats(self) -> dict[str, int | bool]:
        """Counters: ``conversations`` held, ``turns`` and ``blocks``/``sub_blocks`` recorded
        (distinct ids per conversation, summed), ``tombstones``, ``amnesic``, and since
        creation ``evicted`` (LRU), ``expired`` (TTL), ``aborted`` turns and ``unnumbered``
        turns (an amnesic store waiting for the app's number). Walks every conversation: for
        monitoring."""
        with self._lock:
            self._expire(self._clock())
            held = self._conversations.values()
            return {
                "conversations": len(self._conversations),
                "turns": sum(len(c.turns) for c in held),
                "blocks": sum(len(c.blocks) for c in held),
                "sub_blocks": sum(len(c.sub_blocks) for c in held),
                "tombstones": len(self._tombstones),
                "amnesic": self._amnesic,
                **self._counters,
            }

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, *, final: bool = False) -> dict[str, Any]:
        """A JSON-serialisable copy: every held conversation's committed turns (ids as decimal
        strings), tombstones, least recently used first.

        Args:
            final: the owner plans nothing after this snapshot (taken at shutdown), so a store
                restored from it misses no turn and is not amnesic. A checkpoint taken while
                planning goes on (``False``) may miss the turns planned after it.
        """
        # Under the lock only a copy of references (records are immutable tuples); the JSON
        # form is built after, so planning is not held up by a large store.
        with self._lock:
            now = self._clock()
            held = [(key, c.copy(now)) for key, c in self._conversations.items()]
            buried = list(self._tombstones.items())
            amnesic = self._amnesic
        return {
            "version": CONVERSATION_SNAPSHOT_VERSION,
            "final": bool(final),
            "amnesic": amnesic,
            "conversations": [
                {"tenant": key[0], "conversation_id": key[1], **ConversationRecords.json_of(c)}
                for key, c in held
            ],
            "tombstones": [
                [key[0], key[1], latest, continuous] for key, (latest, continuous) in buried
            ],
        }

    def restore(self, snapshot: object, *, checkpoint: bool = False) -> int:
        """Replace the store's content with :meth:`snapshot` output; returns the conversations
        restored. From a checkpoint (not ``final``, or ``checkpoint=True``: the owner knows
        planning went on after it) only the turn numbers are kept and the store is amnesic
        (module docstring).

        Raises:
            ValueError: a malformed snapshot (the store is then left empty and amnesic).
        """
        with self._lock:
            self._conversations.clear()
            self._tombstones.clear()
            self._amnesic = True
            if checkpoint and isinstance(snapshot, dict):
                snapshot = {**snapshot, "final": False}
            try:
                count = self._load(snapshot)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                self._conversations.clear()
                self._tombstones.clear()
                raise ValueError(f"malformed conversation snapshot: {exc!r:.200}") from None
            assert isinstance(snapshot, dict)  # _load checked it
            self._amnesic = not self._final_of(snapshot) or snapshot.get("amnesic") is not False
            return count

    @staticmethod
    def _final_of(snapshot: object) -> bool:
        return isinstance(snapshot, dict) and snapshot.get("final") is True

    # ------------------------------------------------------------------ internals
    def _create(self, key: tuple[str, str], now: float) -> ConversationRecords:
        tombstone = self._tombstones.pop(key)
        if tombstone is not None:
            latest, continuous = tombstone
            conversation = ConversationRecords(
                now, floor=latest, continuous=continuous and not self._amnesic
            )
        else:
            conversation = ConversationRecords(now, continuous=not self._amnesic)
        for dropped_key, dropped in self._conversations.put(key, conversation):
            self._counters["evicted"] += 1
            self._bury(dropped_key, dropped)
        return conversation

    def _bury(self, key: tuple[str, str], conversation: ConversationRecords) -> None:
        latest = conversation.latest_turn()
        if latest is None:
            return
        if self._tombstones.put(key, (latest, conversation.continuous)):
            # A forgotten tombstone: that conversation could come back numbered from 1.
            self._amnesic = True

    def _commit(
        self, conversation: ConversationRecords, turn: int | None, records: Sequence[Record]
    ) -> None:
        """A turn's ``on_commit``: its records enter the conversation's history."""
        if turn is None:  # unnumbered: nothing to point to later
            return
        with self._lock:
            conversation.pending.discard(turn)
            conversation.add(turn, records)
            while len(conversation.turns) > self.max_turns:
                conversation.drop_turn(min(conversation.turns))

    def _abort(self, conversation: ConversationRecords, turn: int | None) -> None:
        """A turn's ``on_abort``: its number is released."""
        with self._lock:
            if turn is not None:
                conversation.pending.discard(turn)
            self._counters["aborted"] += 1

    def _expire(self, now: float) -> None:
        """Drop conversations unused for ``ttl_seconds``; they sit at the LRU front."""
        if self.ttl_seconds is None:
            return
        deadline = now - self.ttl_seconds
        while (oldest := self._conversations.oldest()) is not None:
            if oldest[1].last_used > deadline:
                break
            key, conversation = self._conversations.pop_oldest()
            self._bury(key, conversation)
            self._counters["expired"] += 1

    def _load(self, snapshot: object) -> int:
        version = CONVERSATION_SNAPSHOT_VERSION
        if not isinstance(snapshot, dict) or snapshot.get("version") != version:
            raise ValueError(f"conversation snapshot version must be {version}")
        now = self._clock()
        for entry in snapshot["tombstones"]:
            # After a checkpoint the store cannot vouch for its numbering: not continuous.
            tenant, conversation_id, latest, continuous = entry
            key = _conversation_key(tenant, conversation_id)
            latest = nonnegative_int("tombstone turn", latest)
            self._tombstones.put(key, (latest, self._final_of(snapshot) and continuous is True))
        final = self._final_of(snapshot)
        for entry in snapshot["conversations"]:
            key = _conversation_key(entry["tenant"], entry["conversation_id"])
            conversation = ConversationRecords.from_json(entry, now, final=final)
            if final:
                self._conversations.put(key, conversation)
            else:  # a checkpoint: keep the numbering, not the records
                latest = conversation.latest_turn()
                if latest is not None:
                    self._tombstones.put(key, (latest, False))
        return len(self._conversations)


def _conversation_key(tenant: object, conversation_id: object) -> tuple[str, str]:
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, got {type(tenant).__name__}: {tenant!r:.80}")
    if not isinstance(conversation_id, str):
        raise TypeError(
            f"conversation_id must be a non-empty str, got {type(conversation_id).__name__}: "
            f"{conversation_id!r:.80}"
        )
    if not conversation_id:
        raise ValueError("conversation_id must be a non-empty str (use None for no conversation)")
    return tenant, conversation_id


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r:.80}")
