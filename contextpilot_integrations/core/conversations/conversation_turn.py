"""One conversation turn being planned: where its blocks already stand, and what it shows.

:meth:`ConversationStore.open_turn <.conversation.ConversationStore.open_turn>` yields a
:class:`ConversationTurn`. Inside that ``with`` block the planner asks where a block or
sub-block already stands in full (in the earlier turns the turn's
:class:`~.turns.TurnVisibility` lets it see, else earlier in this turn) and records what this
turn's prompt shows; the records enter the store's history only on
:meth:`ConversationTurn.commit` (the store's two phases, :mod:`.conversation`). The turn knows
nothing of the store: it is given the conversation's records to read and the two calls that
end it (``on_commit``, ``on_abort``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contextpilot_integrations.core.conversations.conversation_records import (
    ConversationRecords,
    Record,
)
from contextpilot_integrations.core.conversations.turns import Location, TurnVisibility

__all__ = ["ConversationTurn"]


class ConversationTurn:
    """One turn being planned: lookups in the visible history and records for this turn.

    Obtained from :meth:`ConversationStore.open_turn`. Lookups and records are valid inside
    that ``with`` block; afterwards the turn is *pending* until :meth:`commit` (its records
    enter the history) or :meth:`abort` (they are dropped and its number released).

    Args:
        conversation: the conversation's committed records (read under the store's lock,
            which ``open_turn`` holds while the turn is open).
        key: ``(tenant, conversation_id)``.
        turn, visibility: as the attributes.
        on_commit: ``on_commit(records)``, called once by :meth:`commit` with what this turn
            recorded, in order.
        on_abort: ``on_abort()``, called once by :meth:`abort`.

    Attributes:
        tenant, conversation_id: the conversation's key.
        turn: this turn's number; ``None`` when the store cannot number it (an amnesic store,
            see the module docstring): it then records nothing.
        number: the number its own places carry (``turn``, or ``-1`` when unnumbered); compare
            a found place's turn with it to tell "in this message" from an earlier turn.
        visibility: the earlier turns lookups may return.
    """

    __slots__ = (
        "_conversation",
        "_on_abort",
        "_on_commit",
        "_open",
        "_own_blocks",
        "_own_sub_blocks",
        "_records",
        "_state",
        "conversation_id",
        "number",
        "tenant",
        "turn",
        "visibility",
    )

    def __init__(
        self,
        conversation: ConversationRecords,
        key: tuple[str, str],
        turn: int | None,
        visibility: TurnVisibility,
        *,
        on_commit: Callable[[Sequence[Record]], None],
        on_abort: Callable[[], None],
    ) -> None:
        self._on_commit = on_commit
        self._on_abort = on_abort
        self._conversation = conversation
        self._open = True
        self._state = "open"
        self._records: list[Record] = []
        self._own_blocks: dict[int, Location] = {}
        self._own_sub_blocks: dict[int, Location] = {}
        self.tenant, self.conversation_id = key
        self.turn = turn
        self.number = -1 if turn is None else turn
        self.visibility = visibility

    def find_block(self, block_id: int) -> Location | None:
        """The first visible place where the block with this id stands in full (an earlier
        turn's, else this turn's own), or ``None``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        self._live()
        found = self._first_visible(self._conversation.blocks.get(block_id))
        return found if found is not None else self._own_blocks.get(block_id)

    def find_sub_block(self, sub_block_id: int) -> Location | None:
        """The first visible place where this sub-block stands in full, or ``None``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        self._live()
        found = self._first_visible(self._conversation.sub_blocks.get(sub_block_id))
        return found if found is not None else self._own_sub_blocks.get(sub_block_id)

    def record_block(self, block_id: int, label: str) -> None:
        """Record that this turn's prompt shows the block in full under ``label``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        self._live()
        self._records.append((False, block_id, label, None))
        self._own_blocks.setdefault(block_id, Location(self.number, label))

    def record_sub_block(self, sub_block_id: int, label: str, part: int) -> None:
        """Record that this turn's prompt shows the sub-block, as part ``part`` (0-based) of the
        block labelled ``label``.

        Raises:
            RuntimeError: used outside its ``open_turn`` block.
        """
        self._live()
        self._records.append((True, sub_block_id, label, part))
        self._own_sub_blocks.setdefault(sub_block_id, Location(self.number, label, part))

    def commit(self) -> None:
        """The turn's prompt was handed out: its records enter the history. Idempotent;
        a no-op after :meth:`abort`."""
        if self._state == "pending":
            self._on_commit(self._records)
            self._state = "committed"

    def abort(self) -> None:
        """The turn's plan was not handed out: drop its records, release its number.
        Idempotent; a no-op after :meth:`commit`."""
        if self._state in ("open", "pending"):
            self._on_abort()
            self._state = "aborted"

    def close(self, *, failed: bool) -> None:
        """End the ``open_turn`` block (the store calls it): lookups and records are refused
        from now on, and the turn is pending, or aborted when the block raised (``failed``:
        the store has released its number itself, so ``on_abort`` is not called)."""
        self._open = False
        if self._state == "open":
            self._state = "aborted" if failed else "pending"

    def _live(self) -> None:
        if not self._open:
            raise RuntimeError("ConversationTurn used after its open_turn block ended")

    def _first_visible(self, places: list[Location] | None) -> Location | None:
        if not places:
            return None
        visibility = self.visibility
        for place in places:
            if self.turn is not None:
                if visibility.includes(place.turn, self.turn):
                    return place
            # Unnumbered: the app's current turn is unknown, so a window of the last n turns
            # cannot be placed; all turns, or an explicit set, still can.
            elif visibility.last_turns is None and (
                visibility.turns is None or place.turn in visibility.turns
            ):
                return place
        return None
