"""When a planning window closes: the closing rule alone, in virtual time.

:class:`WindowPolicy` is the rule :class:`~.planning_window.PlanningWindow` closes its windows
by (the planning window's module docstring states it); :class:`ArrivalRate` is the recent
arrival rate its adaptive form reads, :class:`OpenWindow` one window's requests so far. Nothing
here sleeps or locks, so the benchmark replays an arrival process through the same rule without
sleeping (:meth:`WindowPolicy.group`; ``contextpilot-bench --mode online --arrival poisson
--window-ms W``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from contextpilot_integrations.core.blocks import block_id
from contextpilot_integrations.core.request import PlanRequest, is_block_text

__all__ = ["ArrivalRate", "OpenWindow", "WindowPolicy"]

MemberT = TypeVar("MemberT")


@dataclass(frozen=True)
class WindowPolicy:
    """When a window closes.

    Attributes:
        window_s: how long the first request of a window may wait for others (seconds, >= 0).
        max_batch: most requests in one window (>= 1).
        adaptive: close at once when fewer than one more request is expected within the
            window, and at half the length when no two requests share a block yet.

    Raises:
        ValueError: a negative ``window_s`` or a ``max_batch`` below 1.
    """

    window_s: float = 0.010
    max_batch: int = 64
    adaptive: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.window_s, bool) or not self.window_s >= 0:
            raise ValueError(f"window_ms must be >= 0, got {self.window_s * 1000!r}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int):
            raise ValueError(f"max_batch must be an int >= 1, got {self.max_batch!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {self.max_batch!r}")

    def deadline(self, window: OpenWindow[Any]) -> float:
        """When ``window`` closes unless it fills up first (the clock's seconds)."""
        if not self.adaptive:
            return window.opened + self.window_s
        if window.sparse and len(window.members) == 1:
            return window.opened  # nobody else is expected: waiting buys nothing
        if not window.shares_a_block:
            return window.opened + self.window_s / 2
        return window.opened + self.window_s

    def admits(self, window: OpenWindow[Any], request: PlanRequest) -> bool:
        """Whether ``request`` may join ``window`` (room left, not a second turn of one of its
        conversations, not a rid it already holds)."""
        if len(window.members) >= self.max_batch:
            return False
        conversation = request.scope.conversation
        if conversation is not None and conversation in window.conversations:
            return False
        return request.rid is None or request.rid not in window.rids

    def group(self, arrivals: Sequence[tuple[float, PlanRequest]]) -> list[tuple[float, list[int]]]:
        """Replay ``arrivals`` (time in seconds, request; in time order) through the rule.

        Returns:
            ``(close time, indices into arrivals)`` per window, in closing order.
        """
        windows: list[tuple[float, list[int]]] = []
        open_window: OpenWindow[PlanRequest] | None = None
        rate = ArrivalRate()
        for index, (arrived, request) in enumerate(arrivals):
            rate.arrive(arrived)
            if open_window is not None:
                closes = self.deadline(open_window)
                if arrived >= closes or not self.admits(open_window, request):
                    windows.append((min(closes, arrived), open_window.indices))
                    open_window = None
            if open_window is None:
                open_window = OpenWindow(arrived, sparse=rate.expected(self.window_s) < 1.0)
            open_window.add(request, request, index=index, track_blocks=self.adaptive)
            if len(open_window.members) >= self.max_batch or self.window_s == 0:
                windows.append((arrived, open_window.indices))
                open_window = None
        if open_window is not None:
            windows.append((self.deadline(open_window), open_window.indices))
        return windows


class ArrivalRate:
    """An exponentially weighted mean of the gaps between arrivals (seconds), to predict how
    many requests arrive within a window. Not thread-safe (its owner holds a lock)."""

    __slots__ = ("_last", "mean_gap")

    WEIGHT = 1 / 8  # the last 8 or so gaps dominate

    def __init__(self) -> None:
        self._last: float | None = None
        self.mean_gap: float | None = None

    def arrive(self, now: float) -> None:
        """One more request arrived at ``now``."""
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self.mean_gap = (
                gap
                if self.mean_gap is None
                else (self.mean_gap + self.WEIGHT * (gap - self.mean_gap))
            )
        self._last = now

    def expected(self, window_s: float) -> float:
        """Requests expected within ``window_s`` (0 before two arrivals were seen)."""
        if self.mean_gap is None:
            return 0.0
        return window_s / self.mean_gap if self.mean_gap > 0 else float("inf")


@dataclass
class OpenWindow(Generic[MemberT]):
    """The requests of one window so far, with what the closing rule reads.

    ``members`` holds one entry per request, whatever its owner waits on: a
    :class:`~.planning_window.PlanningWindow` caller waiting for its plan, or the request itself
    when :meth:`WindowPolicy.group` replays arrivals. ``closed`` and ``wake`` are the live
    window's (:class:`~.planning_window.PlanningWindow`), as ``planning``; the rule reads none.
    """

    opened: float
    sparse: bool = False  # the arrival rate predicted no other request within the window
    members: list[MemberT] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    conversations: set[tuple[str, str]] = field(default_factory=set)
    rids: set[str] = field(default_factory=set)
    blocks: set[int] = field(default_factory=set)
    shares_a_block: bool = False
    closed: bool = False
    planning: bool = False  # its requests were taken for planning: none joins or leaves now
    wake: Callable[[], None] | None = None  # wakes the thread waiting to close the window
    held_since: float | None = None  # when a live window's hold kept it open past its time

    def add(
        self,
        request: PlanRequest,
        member: MemberT,
        *,
        index: int = -1,
        track_blocks: bool = True,
    ) -> None:
        """Add ``request`` (its owner's ``member``; ``index`` into the replayed arrivals)."""
        self.members.append(member)
        self.indices.append(index)
        if request.scope.conversation is not None:
            self.conversations.add(request.scope.conversation)
        if request.rid is not None:
            self.rids.add(request.rid)
        if track_blocks and not self.shares_a_block:  # only the adaptive rule reads it
            ids = {block_id(text) for text in request.blocks if is_block_text(text)}
            self.shares_a_block = not ids.isdisjoint(self.blocks)
            self.blocks |= ids

    def remove(self, member: MemberT, request: PlanRequest) -> None:
        """Take ``member`` (whose request is ``request``) out again: its caller gave up before
        the window was planned. Its conversation and rid may join again; the blocks it brought
        still count as seen (at most they keep the adaptive window open its full length).

        Raises:
            ValueError: ``member`` is not in the window.
        """
        position = next((i for i, held in enumerate(self.members) if held is member), None)
        if position is None:
            raise ValueError("the member to remove is not in this window")
        del self.members[position]
        del self.indices[position]
        if request.scope.conversation is not None:
            self.conversations.discard(request.scope.conversation)
        if request.rid is not None:
            self.rids.discard(request.rid)
