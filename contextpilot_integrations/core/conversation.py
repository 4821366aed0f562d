"""Per-conversation memory of what earlier prompts already showed the model.

Multi-turn de-duplication (ContextPilot, MLSys 2026, "multi-turn de-duplication") replaces a
context block that an earlier turn of the same conversation already sent by a hint naming where
it stands. That needs, per conversation, the blocks and sub-blocks rendered in full in each turn
and their place: turn number, prompt label (``"[Doc 3]"``) and, for a sub-block, its index in
that block. :class:`ConversationStore` keeps it:

- keyed by ``(tenant, conversation_id)``; a ``None`` conversation id is never stored or matched
  (there is no shared default conversation, DESIGN.md invariant 2);
- bounded (invariant 6): at most ``max_conversations`` conversations, least recently used
  evicted first; a conversation unused for ``ttl_seconds`` expires; at most ``max_turns`` turns
  per conversation, oldest dropped first;
- thread-safe: one lock; a turn is read and recorded inside :meth:`ConversationStore.open_turn`,
  so concurrent requests see whole turns.

Which earlier turns may be pointed to is the application's call: the prompt it sends may have
dropped or summarised old turns. :class:`TurnVisibility` says which earlier turns the prompt
still holds (all of them, the last ``n``, or an explicit set); lookups only return places in
those turns or in the current one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["ConversationStore", "ConversationTurn", "Location", "TurnVisibility"]


@dataclass(frozen=True, slots=True)
class Location:
    """Where a text stands in a conversation's prompts.

    Attributes:
        turn: the turn number whose prompt shows the text.
        label: the block's label in that prompt (``"[Doc 3]"``).
        part: ``None`` when the text is the whole block; else the 0-based index of the
            sub-block within that block (:class:`~contextpilot_integrations.core.chunking`).
    """

    turn: int
    label: str
    part: int | None = None


@dataclass(frozen=True, slots=True)
class TurnVisibility:
    """Which earlier turns the application's prompt still holds.

    The current turn is always visible. Build one with :meth:`all`, :meth:`last` or
    :meth:`only`.

    Attributes:
        last_turns: with :meth:`last`, the window size ``n``; else ``None``.
        turns: with :meth:`only`, the visible earlier turn numbers; else ``None``.
    """

    last_turns: int | None = None
    turns: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.last_turns is not None and self.turns is not None:
            raise ValueError("TurnVisibility takes last_turns or turns, not both")

    @classmethod
    def all(cls) -> TurnVisibility:
        """Every earlier turn is still in the prompt (the default)."""
        return cls()

    @classmethod
    def last(cls, n: int) -> TurnVisibility:
        """Only the ``n`` turns before the current one (turn numbers ``current - n`` to
        ``current - 1``); ``n = 0`` hides every earlier turn.

        Raises:
            TypeError: ``n`` is not an ``int``.
            ValueError: ``n < 0``.
        """
        _check_int("n", n)
        if n < 0:
            raise ValueError(f"n (the number of visible earlier turns) must be >= 0, got {n}")
        return cls(last_turns=n)

    @classmethod
    def only(cls, turns: Iterable[int]) -> TurnVisibility:
        """Only the given earlier turn numbers (others were dropped or summarised).

        Raises:
            TypeError: ``turns`` is not an iterable of ``int``.
        """
        if isinstance(turns, (str, bytes)) or not isinstance(turns, Iterable):
            raise TypeError(f"turns must be an iterable of int, got {type(turns).__name__}")
        visible = frozenset(turns)
        for turn in visible:
            _check_int("turns[...]", turn)
        return cls(turns=visible)

    def includes(self, turn: int, current: int) -> bool:
        """Whether ``turn``'s prompt is visible when ``current`` is being planned."""
        if turn == current:
            return True
        if turn > current:
            return False
        if self.last_turns is not None:
            return turn >= current - self.last_turns
        if self.turns is not None:
            return turn in self.turns
        return True


_ALL_TURNS = TurnVisibility()


class _Conversation:
    """Records of one conversation. Only touched with the store's lock held."""

    __slots__ = ("blocks", "last_used", "sub_blocks", "turns")

    def __init__(self, now: float) -> None:
        # id -> places where the text stands in full, in turn order
        self.blocks: dict[int, list[Location]] = {}
        self.sub_blocks: dict[int, list[Location]] = {}
        # turn -> ids recorded in that turn (is_sub_block, id), to drop a turn in one pass
        self.turns: dict[int, list[tuple[bool, int]]] = {}
        self.last_used = now

    def drop_turns_from(self, turn: int) -> None:
        for old in [t for t in self.turns if t >= turn]:
            self.drop_turn(old)

    def drop_turn(self, turn: int) -> None:
        for is_sub, key in self.turns.pop(turn, ()):
            table = self.sub_blocks if is_sub else self.blocks
            places = table.get(key)
            if places is None:
                continue
            kept = [place for place in places if place.turn != turn]
            if kept:
                table[key] = kept
            else:
                del table[key]

    def latest_turn(self) -> int | None:
        return max(self.turns) if self.turns else None


class ConversationTurn:
    """One turn being planned: lookups in the visible history and records for this turn.

    Obtained from :meth:`ConversationStore.open_turn`; valid only inside that ``with`` block
    (the store's lock is held meanwhile).

    Attributes:
        tenant, conversation_id: the conversation's key.
        turn: this turn's number.
        visibility: the earlier turns lookups may return.
    """

    __slots__ = ("_conversation", "_open", "conversation_id", "tenant", "turn", "visibility")

    def __init__(
        self,
        conversation: _Conversation,
        tenant: str,
        conversation_id: str,
        turn: int,
        visibility: TurnVisibility,
    ) -> None:
        self._conversation = conversation
        self._open = True
        self.tenant = tenant
        self.conversation_id = conversation_id
        self.turn = turn
        self.visibility = visibility

    def find_block(self, block_id: int) -> Location | None:
        """The first visible place where the block with this id stands in full, or ``None``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        return self._first_visible(self._live().blocks.get(block_id))

    def find_sub_block(self, sub_block_id: int) -> Location | None:
        """The first visible place where this sub-block stands in full, or ``None``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        return self._first_visible(self._live().sub_blocks.get(sub_block_id))

    def record_block(self, block_id: int, label: str) -> None:
        """Record that this turn's prompt shows the block in full under ``label``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        conversation = self._live()
        conversation.blocks.setdefault(block_id, []).append(Location(self.turn, label))
        conversation.turns.setdefault(self.turn, []).append((False, block_id))

    def record_sub_block(self, sub_block_id: int, label: str, part: int) -> None:
        """Record that this turn's prompt shows the sub-block, as part ``part`` (0-based) of the
        block labelled ``label``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        conversation = self._live()
        place = Location(self.turn, label, part)
        conversation.sub_blocks.setdefault(sub_block_id, []).append(place)
        conversation.turns.setdefault(self.turn, []).append((True, sub_block_id))

    def _live(self) -> _Conversation:
        if not self._open:
            raise RuntimeError("ConversationTurn used after its open_turn block ended")
        return self._conversation

    def _first_visible(self, places: list[Location] | None) -> Location | None:
        if places:
            for place in places:
                if self.visibility.includes(place.turn, self.turn):
                    return place
        return None


class ConversationStore:
    """Bounded, thread-safe store of the blocks each conversation's earlier turns sent.

    Args:
        max_conversations: most conversations kept; the least recently used is evicted first.
        ttl_seconds: a conversation unused for this long (seconds, by ``clock``) expires;
            ``None`` for no time limit.
        max_turns: most turns kept per conversation; the oldest turn's records are dropped
            first (hints never point to a dropped turn).
        clock: monotonic time source in seconds (injectable for tests).

    Raises:
        TypeError: a bound is not a number of the right kind.
        ValueError: ``max_conversations < 1``, ``max_turns < 1`` or ``ttl_seconds <= 0``.
    """

    def __init__(
        self,
        *,
        max_conversations: int = 10_000,
        ttl_seconds: float | None = 3600.0,
        max_turns: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_int("max_conversations", max_conversations)
        _check_int("max_turns", max_turns)
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be >= 1, got {max_conversations}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
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
        self._conversations: OrderedDict[tuple[str, str], _Conversation] = OrderedDict()
        self._evicted = 0
        self._expired = 0

    @contextmanager
    def open_turn(
        self,
        tenant: str,
        conversation_id: str,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
    ) -> Iterator[ConversationTurn]:
        """Hold the store for planning one turn of a conversation.

        Creates the conversation if needed and marks it used. Planning a turn number that is
        not after the conversation's latest recorded turn (a retry, or an edited history) first
        drops the records of that turn and every later one. After the block, turns beyond
        ``max_turns`` are dropped, oldest first.

        Args:
            tenant: the tenant (``""`` for a single-tenant app).
            conversation_id: the conversation; must be a non-empty ``str`` (callers skip the
                store when a request has no conversation).
            turn: this turn's number (``int >= 0``); ``None`` for one after the latest recorded
                turn (``1`` in a new conversation).
            visibility: the earlier turns the app's prompt still holds; ``None`` for all.

        Yields:
            The :class:`ConversationTurn` to look up and record with (the store's lock is held
            until the block ends; keep the work inside short).

        If the block raises, this turn's records are dropped.

        Raises:
            TypeError / ValueError: bad ``tenant``, ``conversation_id``, ``turn`` or
                ``visibility`` (the message names the field and value).
        """
        key = _conversation_key(tenant, conversation_id)
        if turn is not None:
            _check_int("turn", turn)
            if turn < 0:
                raise ValueError(f"turn must be >= 0, got {turn}")
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
                conversation = _Conversation(now)
                self._conversations[key] = conversation
                while len(self._conversations) > self.max_conversations:
                    self._conversations.popitem(last=False)
                    self._evicted += 1
            else:
                self._conversations.move_to_end(key)
                conversation.last_used = now
            latest = conversation.latest_turn()
            if turn is None:
                turn = 1 if latest is None else latest + 1
            elif latest is not None and turn <= latest:
                conversation.drop_turns_from(turn)
            # The turn counts even if it records nothing (every block replaced by a hint), so
            # the next turn gets the next number and its hints name the right turns.
            conversation.turns.setdefault(turn, [])
            handle = ConversationTurn(conversation, key[0], key[1], turn, visibility)
            try:
                yield handle
            except BaseException:
                conversation.drop_turn(turn)  # a half-recorded turn must not be pointed to
                raise
            finally:
                handle._open = False
                while len(conversation.turns) > self.max_turns:
                    conversation.drop_turn(min(conversation.turns))

    def forget(self, tenant: str, conversation_id: str) -> bool:
        """Drop a conversation's records (the user deleted it). ``False`` if unknown."""
        key = _conversation_key(tenant, conversation_id)
        with self._lock:
            return self._conversations.pop(key, None) is not None

    def __contains__(self, key: object) -> bool:
        """``(tenant, conversation_id) in store``: the conversation is held and not expired."""
        with self._lock:
            self._expire(self._clock())
            return key in self._conversations

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._conversations)

    def stats(self) -> dict[str, int]:
        """Counters: ``conversations`` held, ``turns`` and ``blocks``/``sub_blocks`` recorded
        (distinct ids per conversation, summed), ``evicted`` (LRU) and ``expired`` (TTL) since
        creation. Walks every conversation: for monitoring, not the hot path."""
        with self._lock:
            self._expire(self._clock())
            held = self._conversations.values()
            return {
                "conversations": len(self._conversations),
                "turns": sum(len(c.turns) for c in held),
                "blocks": sum(len(c.blocks) for c in held),
                "sub_blocks": sum(len(c.sub_blocks) for c in held),
                "evicted": self._evicted,
                "expired": self._expired,
            }

    def _expire(self, now: float) -> None:
        """Drop conversations unused for ``ttl_seconds``; they sit at the LRU front."""
        if self.ttl_seconds is None:
            return
        deadline = now - self.ttl_seconds
        while self._conversations:
            key, oldest = next(iter(self._conversations.items()))
            if oldest.last_used > deadline:
                break
            del self._conversations[key]
            self._expired += 1


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
