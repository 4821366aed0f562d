"""What the service client remembers of each conversation: its turn numbers across service
restarts, and what a failed call may have left on the service (docs/DESIGN.md, "Sure hints").

**Turn numbers.** A service restarted without its snapshot numbers a conversation afresh (or,
amnesic, not at all). :class:`ConversationMemory` remembers, per ``(tenant, conversation_id)``
(LRU, ``max_conversations``), the service's boot id (:data:`~.schemas.BOOT_HEADER`) and the
last turn number the app received. When a plan of a turn the caller did not number comes back

- from the same service start, or numbered after the remembered turn (a restored final
  snapshot): it stands, and is remembered;
- otherwise: it is returned renumbered as the remembered number + 1 (the fresh store held no
  earlier turn to point at), the conversation is forgotten on the service, and its later
  requests go out with explicit turn numbers. A plan that does hint (another process planned
  the conversation meanwhile) is planned locally instead, and its rid evicted.

**Unsettled calls.** A call that failed after it was sent may have been planned by the
service (a phantom turn a later hint could point to). Its conversations and explicit rids are
remembered (LRU, ``max_unsettled``) and settled (forgotten, evicted) before the next service
call that touches them (:meth:`ConversationMemory.unsettled_among`). A local plan does not
advance the remembered turn number.

Thread-safe: one lock. Turns of one conversation are expected one after the other (as the
core's batches require).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from contextpilot_integrations.core.conversations.turns import next_turn
from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.plan import PlacementStatus, Plan
from contextpilot_integrations.core.request import PlanRequest

__all__ = ["ConversationMemory", "Received", "SettleKey", "TurnMemory", "points_back"]

# Every message of the client logs under the client's module name, wherever it is written.
logger = logging.getLogger("contextpilot_integrations.client.client")

SettleKey = tuple[str, ...]
"""What a call may have left on the service: ``("conversation", tenant, conversation_id)``
(forget it) or ``("rid", rid)`` (evict it)."""

DEFAULT_MAX_CONVERSATIONS = 10_000
DEFAULT_MAX_UNSETTLED = 10_000


@dataclass(frozen=True, slots=True)
class TurnMemory:
    """What the client remembers of one conversation's numbering.

    Attributes:
        boot: the service start (boot id) that planned its last turn; ``None`` when the
            service sent none.
        turn: the number of the last turn the app received from the service.
        client_numbered: the client sends the conversation's turn numbers (since a restart
            renumbered it).
    """

    boot: str | None
    turn: int
    client_numbered: bool = False


@dataclass(frozen=True, slots=True)
class Received:
    """What to do with one plan the service returned.

    Attributes:
        plan: the plan to return (as is, or renumbered); ``None``: plan the request locally
            with ``turn``.
        turn: the turn number of the local plan (when ``plan`` is ``None``).
        settle: what to undo on the service now (best effort; kept as unsettled when it fails).
    """

    plan: Plan | None
    turn: int | None = None
    settle: tuple[SettleKey, ...] = ()


class ConversationMemory:
    """Per conversation, the turn numbering; and the unsettled conversations and rids.

    Args:
        max_conversations: most conversations whose numbering is remembered (LRU); a
            conversation dropped goes back to the service's numbering.
        max_unsettled: most conversations and rids remembered as possibly planned by the
            service after a failed call (LRU; dropping one is logged).

    Raises:
        ValueError: a bound that is not an int >= 1.
    """

    def __init__(
        self,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        max_unsettled: int = DEFAULT_MAX_UNSETTLED,
    ) -> None:
        for name, value in (
            ("max_conversations", max_conversations),
            ("max_unsettled", max_unsettled),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._lock = threading.Lock()
        self._turns: LRU[tuple[str, str], TurnMemory] = LRU(max_conversations)
        self._unsettled: LRU[SettleKey, None] = LRU(max_unsettled)
        self._counters = {
            "settled": 0,
            "unsettled_dropped": 0,
            "renumbered": 0,
            "renumber_refused": 0,
        }

    # ------------------------------------------------------------------ Public API: numbering
    def to_send(self, request: PlanRequest) -> PlanRequest:
        """``request`` as it goes to the service: with the next turn number when the client
        numbers its conversation and the caller gave none (else unchanged).

        Raises:
            ValueError: the remembered turn is the largest turn number (``next_turn``).
        """
        key = request.scope.conversation
        if key is None or request.scope.turn is not None:
            return request
        with self._lock:
            memory = self._turns.peek(key)
        if memory is None or not memory.client_numbered:
            return request
        scope = dataclasses.replace(request.scope, turn=next_turn(key[1], memory.turn))
        return dataclasses.replace(request, scope=scope)

    def received(
        self, request: PlanRequest, sent: PlanRequest, plan: Plan, boot: str | None
    ) -> Received:
        """The service planned ``sent`` (``request`` as the caller made it) into ``plan``, in
        its start ``boot``: remember the turn, and say what to return (module docstring).

        Mutates: the conversation's :class:`TurnMemory`; the counters.

        Raises:
            ValueError: the service numbered afresh and the remembered turn is the largest
                turn number (``next_turn``); what the service recorded is settled before the
                conversation's next call.
        """
        key = request.scope.conversation
        if key is None:
            return Received(plan)
        given = plan.scope.turn
        with self._lock:
            memory = self._turns.get(key)
            if request.scope.turn is not None or memory is None or sent.scope.turn is not None:
                # The caller's own number, a conversation met first, or the client's number:
                # the plan's number is the app's.
                if given is not None:
                    numbered = memory is not None and memory.client_numbered
                    self._turns.put(key, TurnMemory(boot, given, numbered))
                return Received(plan)
            if given is not None and (boot == memory.boot or given > memory.turn):
                # The same service, or one that went on from where it was (a final snapshot).
                self._turns.put(key, TurnMemory(boot, given))
                return Received(plan)
            # Numbered afresh (or not at all): the app's next number is the remembered one + 1.
            try:
                turn = next_turn(key[1], memory.turn)
            except ValueError:  # none is left: what the service recorded is settled later
                for settle in (("conversation", *key), ("rid", plan.rid)):
                    self._counters["unsettled_dropped"] += len(self._unsettled.put(settle, None))
                raise
            self._turns.put(key, TurnMemory(boot, turn, client_numbered=True))
            forget: tuple[SettleKey, ...] = (("conversation", *key),)
            if points_back(plan):
                self._counters["renumber_refused"] += 1
                refused = forget + (("rid", plan.rid),)
                return Received(None, turn, refused)
            self._counters["renumbered"] += 1
        logger.debug(
            "index service restarted: turn %s of conversation %.80r renumbered %d",
            given,
            key[1],
            turn,
        )
        renumbered = dataclasses.replace(plan, scope=dataclasses.replace(plan.scope, turn=turn))
        return Received(renumbered, settle=forget if given is not None else ())

    # ------------------------------------------------------------------ Public API: unsettled
    @staticmethod
    def touched(requests: Sequence[PlanRequest]) -> list[SettleKey]:
        """What a call of these requests may leave on the service: their conversations and
        explicit rids."""
        touched: list[SettleKey] = []
        for request in requests:
            key = request.scope.conversation
            if key is not None:
                touched.append(("conversation", *key))
            if request.rid is not None:
                touched.append(("rid", request.rid))
        return touched

    def unsettled_among(self, keys: Sequence[SettleKey]) -> list[SettleKey]:
        """Those of ``keys`` a failed call may have left on the service (to settle first)."""
        with self._lock:
            return [key for key in keys if key in self._unsettled]

    def remember_unsettled(self, keys: Sequence[SettleKey]) -> None:
        """A call touching ``keys`` failed after it was sent: settle them before their next
        use. An entry dropped by the bound is logged at warning level."""
        with self._lock:
            dropped = sum(len(self._unsettled.put(key, None)) for key in keys)
            self._counters["unsettled_dropped"] += dropped
        if dropped:
            logger.warning(
                "index service client: %d conversations that failed calls may have left on "
                "the service are no longer remembered (max_unsettled=%d)",
                dropped,
                self._unsettled.max_entries,
            )

    def settled(self, key: SettleKey) -> None:
        """``key`` was forgotten or evicted on the service."""
        with self._lock:
            self._unsettled.pop(key)
            self._counters["settled"] += 1

    def counts(self) -> dict[str, int]:
        """``settled``, ``unsettled`` (now), ``unsettled_dropped``, ``renumbered`` (plans the
        client renumbered after a restart), ``renumber_refused`` (planned locally instead)
        and ``conversations`` (whose numbering is remembered)."""
        with self._lock:
            return {
                **self._counters,
                "unsettled": len(self._unsettled),
                "conversations": len(self._turns),
            }


def points_back(plan: Plan) -> bool:
    """Whether anything in ``plan`` points at text shown elsewhere: a block replaced by a hint,
    or a shown block with sub-block pointers (also "in this message" ones: the wire does not
    say where a pointer points, so every one counts)."""
    return any(
        p.status is PlacementStatus.REPLACED or (p.shown and p.rendered_text != p.text)
        for p in plan.placements
    )
