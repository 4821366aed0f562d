"""The records of one conversation: which blocks each committed turn showed, and where.

Held by :class:`~contextpilot_integrations.core.conversations.conversation.ConversationStore`
(which takes its lock around every use) and written to its snapshot in the JSON form of
:meth:`to_json`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from contextpilot_integrations.core.conversations.turns import Location

__all__ = ["ConversationRecords", "Record", "nonnegative_int"]

Record = tuple[bool, int, str, "int | None"]
"""One place a turn recorded: (is a sub-block, id, label, part)."""

RecordsCopy = tuple[float, int, bool, tuple[tuple[int, tuple[Record, ...]], ...]]
"""A conversation's records as :meth:`ConversationRecords.copy` takes them: (idle seconds,
floor, continuous, ((turn, records), ...))."""


class ConversationRecords:
    """Records of one conversation. Not thread-safe: the store's lock is held around it.

    Attributes:
        blocks, sub_blocks: id -> places where the text stands in full, in turn order
            (committed turns only).
        turns: committed turn number -> its records.
        pending: turn numbers reserved by turns being planned.
        floor: the latest turn number a tombstone remembered (0: none).
        continuous: the store's own numbering agrees with the app's (see the store).
        last_used: the store's clock at the last use.
    """

    __slots__ = (
        "blocks",
        "continuous",
        "floor",
        "last_used",
        "pending",
        "sub_blocks",
        "turns",
    )

    def __init__(self, now: float, *, floor: int = 0, continuous: bool = True) -> None:
        # id -> places where the text stands in full, in turn order (committed turns only)
        self.blocks: dict[int, list[Location]] = {}
        self.sub_blocks: dict[int, list[Location]] = {}
        self.turns: dict[int, list[Record]] = {}  # committed turn -> its records
        self.pending: set[int] = set()  # turn numbers reserved by open turns
        self.floor = floor  # latest turn number known from a tombstone (0: none)
        self.continuous = continuous  # the store's own numbering agrees with the app's
        self.last_used = now

    def latest_turn(self) -> int | None:
        numbers = [*self.turns, *self.pending]
        if self.floor:
            numbers.append(self.floor)
        return max(numbers) if numbers else None

    def add(self, turn: int, records: Iterable[Record]) -> None:
        listed = self.turns.setdefault(turn, [])
        for record in records:
            is_sub, key, label, part = record
            table = self.sub_blocks if is_sub else self.blocks
            table.setdefault(key, []).append(Location(turn, label, part))
            listed.append(record)

    def drop_turns_from(self, turn: int) -> None:
        for old in [t for t in self.turns if t >= turn]:
            self.drop_turn(old)

    def drop_turn(self, turn: int) -> None:
        for is_sub, key, _, _ in self.turns.pop(turn, ()):
            table = self.sub_blocks if is_sub else self.blocks
            places = table.get(key)
            if places is None:
                continue
            kept = [place for place in places if place.turn != turn]
            if kept:
                table[key] = kept
            else:
                del table[key]

    def to_json(self, now: float) -> dict[str, Any]:
        """The JSON form (ids as decimal strings; ``idle_s``: seconds since the last use)."""
        return self.json_of(self.copy(now))

    def copy(self, now: float) -> RecordsCopy:
        """What :meth:`to_json` needs, copied cheaply (under the store's lock); the records
        themselves are immutable tuples, shared."""
        turns = tuple((turn, tuple(records)) for turn, records in sorted(self.turns.items()))
        return max(0.0, now - self.last_used), self.floor, self.continuous, turns

    @staticmethod
    def json_of(copy: RecordsCopy) -> dict[str, Any]:
        """The JSON form of a :meth:`copy` (no lock needed)."""
        idle, floor, continuous, turns = copy
        return {
            "idle_s": idle,
            "floor": floor,
            "continuous": continuous,
            "turns": [
                [turn, [[is_sub, str(key), label, part] for is_sub, key, label, part in records]]
                for turn, records in turns
            ],
        }

    @classmethod
    def from_json(cls, entry: Mapping[str, Any], now: float, *, final: bool) -> ConversationRecords:
        """Records from :meth:`to_json` output; ``continuous`` only kept from a final snapshot.

        Raises:
            KeyError / TypeError / ValueError: a malformed entry.
        """
        idle = float(entry["idle_s"])
        if not idle >= 0:
            raise ValueError(f"idle_s must be >= 0, got {idle!r}")
        records = cls(
            now - idle,
            floor=nonnegative_int("floor", entry["floor"]),
            continuous=final and entry["continuous"] is True,
        )
        for turn, places in entry["turns"]:
            records.add(
                nonnegative_int("turn", turn),
                [
                    (bool(is_sub), _block_id(key), str(label), _part(part))
                    for is_sub, key, label, part in places
                ],
            )
        return records


def nonnegative_int(name: str, value: object) -> int:
    """``value`` when it is an int >= 0.

    Raises:
        TypeError / ValueError: otherwise (the message names ``name``).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r:.80}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _block_id(value: object) -> int:
    number = int(str(value))
    if not 0 <= number < 2**64:
        raise ValueError(f"block id out of range: {value!r:.40}")
    return number


def _part(value: object) -> int | None:
    return None if value is None else nonnegative_int("part", value)
