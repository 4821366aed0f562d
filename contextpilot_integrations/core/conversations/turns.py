"""Where a text stands in a conversation, and which earlier turns a prompt still holds.

The two values multi-turn de-duplication reasons with (:mod:`.conversation`, :mod:`.dedup`): a
:class:`Location` names a place in an earlier (or the current) prompt; a
:class:`TurnVisibility` is the application's statement of which earlier turns its prompt still
sends, so a hint never points at a turn the model no longer sees (docs/DESIGN.md, "Sure hints").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_TURN = 2**31 - 1
"""Largest turn number (also the largest ``scope.turn`` a request may give)."""

__all__ = ["Location", "TurnVisibility"]


@dataclass(frozen=True, slots=True)
class Location:
    """Where a text stands in a conversation's prompts.

    Attributes:
        turn: the turn number whose prompt shows the text.
        label: the block's label in that prompt (``"[Doc 3]"``).
        part: ``None`` when the text is the whole block; else the 0-based index of the
            sub-block within that block
            (:mod:`~contextpilot_integrations.core.conversations.chunking`).
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
            ValueError: a negative turn number.
        """
        if isinstance(turns, (str, bytes)) or not isinstance(turns, Iterable):
            raise TypeError(f"turns must be an iterable of int, got {type(turns).__name__}")
        visible = frozenset(turns)
        for turn in visible:
            _check_int("turns[...]", turn)
            if turn < 0:
                raise ValueError(f"turns[...] must be turn numbers >= 0, got {turn!r}")
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


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r:.80}")


def next_turn(conversation_id: str, latest: int | None) -> int:
    """The number after a conversation's ``latest`` turn (1 when it has none).

    A turn the app numbered :data:`MAX_TURN` (accepted: it is the app's own number) has no
    next number. Rather than a plan numbered past the range, or an error about a number the
    app never sent, the next unnumbered turn is refused, naming the conversation and its
    latest turn; the app gives its own ``scope.turn`` from there (an earlier number replans
    from that turn) or starts a new conversation.

    Raises:
        ValueError: ``latest`` is :data:`MAX_TURN`.
    """
    if latest is None:
        return 1
    if latest >= MAX_TURN:
        raise ValueError(
            f"conversation {conversation_id!r:.80} is at turn {latest}, the largest turn "
            f"number, so its next turn cannot be numbered: give scope.turn (at most "
            f"{MAX_TURN}; an earlier one replans from there) or start a new conversation"
        )
    return latest + 1
