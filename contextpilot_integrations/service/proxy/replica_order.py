"""The proxy's document calls sent to each replica in the order their plans were handed out, and
at most ``max_in_flight`` of them at once per replica (docs/DESIGN.md, "The proxy").

A planning window hands its calls their plans in the batch's schedule order, but each call then
finishes its preparation in a worker thread of its own, and on a loaded machine those threads
reach the upstream in any order: a call sharing its predecessor's prefix can be prefilled before
the predecessor's blocks are in the engine's prefix cache, or beside it. :class:`ReplicaOrder`
holds each call at the door:

- a *ticket* is issued per call, per replica, when its plan is handed out (:meth:`issue`, from
  the window's thread, in schedule order); a call planned alone gets its ticket when it reaches
  the door (:meth:`enter`);
- with ``ordered``, a call goes out only once every earlier ticket of its replica has *started*
  its answer (:meth:`started`: the upstream's first body bytes, which a streaming engine sends
  after the prefill, so the shared prefix is cached before the next call's prefill starts), or
  has finished (:meth:`finish`: answered, failed, cancelled, abandoned);
- at most ``max_in_flight`` of the replica's calls are out at once (sent, not finished), so a
  gateway never sees enough of one key in flight to spill it to another worker, and the load is
  spread in time rather than queued at the engine.

:meth:`backlogged` tells the planning window in front of the router whether every replica has
calls waiting at its door, so the window can go on gathering calls that would wait anyway
(docs/DESIGN.md, "The proxy").

No call waits for good: a ticket whose call has not reached the door ``stale_s`` after it was
issued (its preparation failed after planning, its client left) is dropped, a call that gives
up (cancelled) leaves with :meth:`finish`, and every sent call finishes however its answer ends.
A replica whose call has been out ``stuck_s`` without starting its answer (an engine that
hangs rather than refusing connections) holds nobody any more: its waiting calls go without
order or cap, each then bounded by the upstream's own timeout, instead of one after another
each a timeout later.
Thread-safe: tickets are issued and finished from any thread; :meth:`enter` is awaited on the
event loop and never blocks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "STALE_S", "STUCK_S", "ReplicaOrder"]

DEFAULT_MAX_IN_FLIGHT: int | None = None
"""Document calls the proxy has out at once per replica, by default: no cap. A cap holds calls
back from an engine that batches many at once, so it is the operator's choice (docs/DESIGN.md,
"The proxy")."""

STALE_S = 10.0
"""Seconds a ticket waits for its call to reach the door before it is dropped (a call that
never comes: its preparation failed after planning)."""


STUCK_S = 30.0
"""Seconds a sent call may go without starting its answer before its replica's door stops
holding the calls behind it (a prefill takes far less; an engine that hangs never starts)."""


@dataclass(eq=False)
class _Ticket:
    rid: str
    replica: str
    issued: float
    arrived: bool = False
    sent: bool = False
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class ReplicaOrder:
    """Per replica, the order and the number in flight of the proxy's document calls (module
    docstring).

    Args:
        ordered: send each replica's calls in ticket order, one starting its answer at a time.
        max_in_flight: most calls out at once per replica (>= 1); ``None``: no cap.
        stale_s: seconds an issued ticket waits for its call (> 0).
        stuck_s: seconds a sent call may go without starting its answer before the replica's
            waiting calls go regardless (> 0).
        clock: monotonic seconds.

    Raises:
        ValueError: ``max_in_flight`` below 1, or ``stale_s`` or ``stuck_s`` not positive.
    """

    def __init__(
        self,
        *,
        ordered: bool = False,
        max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
        stale_s: float = STALE_S,
        stuck_s: float = STUCK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight is not None and (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise ValueError(f"max_in_flight must be an int >= 1 or None, got {max_in_flight!r}")
        if not stale_s > 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s!r}")
        if not stuck_s > 0:
            raise ValueError(f"stuck_s must be > 0, got {stuck_s!r}")
        self.stuck_s = stuck_s
        self.ordered = ordered
        self.max_in_flight = max_in_flight
        self.stale_s = stale_s
        self._clock = clock
        self._lock = threading.Lock()
        self._queues: dict[str, list[_Ticket]] = {}  # per replica: not yet started, in order
        self._tickets: dict[str, _Ticket] = {}  # by rid, until finished
        # Per replica, the calls sent and not started yet: rid -> when sent, oldest first.
        self._unstarted: dict[str, dict[str, float]] = {}
        self._in_flight: dict[str, int] = {}
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._counts = {"issued": 0, "waited": 0, "stale": 0, "past_stuck": 0}

    # ------------------------------------------------------------------ Public API
    def issue(self, rid: str, replica: str) -> None:
        """A ticket for the call ``rid`` to ``replica``, behind every one issued before (a
        second ticket for ``rid`` is ignored)."""
        with self._lock:
            self._issue(rid, replica)

    async def enter(self, rid: str, replica: str) -> None:
        """Wait until the call ``rid`` may be sent to ``replica`` (module docstring); a call
        without a ticket gets one now. Cancelling it leaves the ticket to :meth:`finish`."""
        loop = asyncio.get_running_loop()
        waited = False
        while True:
            with self._lock:
                ticket = self._tickets.get(rid) or self._issue(rid, replica)
                ticket.arrived = True
                self._drop_stale(ticket.replica)
                if self._may_go(ticket):
                    ticket.sent = True
                    self._unstarted.setdefault(ticket.replica, {})[ticket.rid] = self._clock()
                    self._in_flight[ticket.replica] = self._in_flight.get(ticket.replica, 0) + 1
                    if waited:
                        self._counts["waited"] += 1
                    return
                future: asyncio.Future[None] = loop.create_future()
                entry = (loop, future)
                self._waiting.append(entry)
            waited = True
            try:
                await asyncio.wait({future}, timeout=self.stale_s)
            finally:
                with self._lock:
                    if entry in self._waiting:
                        self._waiting.remove(entry)

    def started(self, rid: str) -> None:
        """The call ``rid``'s answer started: the next call of its replica may go."""
        with self._lock:
            ticket = self._tickets.get(rid)
            if ticket is None:
                return
            self._unstarted.get(ticket.replica, {}).pop(rid, None)
            queue = self._queues.get(ticket.replica, [])
            if ticket in queue:
                queue.remove(ticket)
                self._wake()

    def finish(self, rid: str) -> None:
        """The call ``rid`` is over (answered, failed, cancelled, abandoned, or never sent):
        its ticket and its place in flight are freed."""
        with self._lock:
            ticket = self._tickets.pop(rid, None)
            if ticket is None:
                return
            self._unstarted.get(ticket.replica, {}).pop(rid, None)
            queue = self._queues.get(ticket.replica, [])
            if ticket in queue:
                queue.remove(ticket)
            if ticket.sent:
                self._in_flight[ticket.replica] -= 1
            self._wake()

    def backlogged(self, replicas: Iterable[str]) -> bool:
        """Whether each of ``replicas`` (at least one) has a call waiting at its door: a ticket
        not sent yet whose call is at the door, or was issued within ``stale_s`` (its call on
        its way from its window). A call planned onto any of them now would wait behind those."""
        names = list(replicas)
        if not names:
            return False
        now = self._clock()
        with self._lock:
            return all(self._waiting_at(name, now) for name in names)

    def stats(self) -> dict[str, object]:
        """``issued`` tickets, calls that ``waited`` at the door, ``stale`` tickets dropped,
        calls let go ``past_stuck`` (a call ahead had not started its answer in ``stuck_s``),
        and per replica the calls ``in_flight``, ``queued`` (not yet started) and ``waiting``
        (not yet sent, as :meth:`backlogged` counts them)."""
        with self._lock:
            now = self._clock()
            return {
                **self._counts,
                "in_flight": dict(self._in_flight),
                "queued": {name: len(queue) for name, queue in self._queues.items()},
                "waiting": {name: self._waiting_at(name, now) for name in self._queues},
            }

    # ------------------------------------------------------------------ internals
    def _issue(self, rid: str, replica: str) -> _Ticket:
        """(The lock is held.)"""
        ticket = self._tickets.get(rid)
        if ticket is None:
            ticket = _Ticket(rid, replica, self._clock())
            self._tickets[rid] = ticket
            self._queues.setdefault(replica, []).append(ticket)
            self._counts["issued"] += 1
        return ticket

    def _waiting_at(self, replica: str, now: float) -> int:
        """``replica``'s tickets not sent yet whose call arrived or may still come (the lock
        is held)."""
        return sum(
            1
            for ticket in self._queues.get(replica, ())
            if not ticket.sent and (ticket.arrived or now - ticket.issued <= self.stale_s)
        )

    def _may_go(self, ticket: _Ticket) -> bool:
        """(The lock is held.)"""
        if self._in_turn(ticket):
            return True
        if self._stuck(ticket.replica):
            self._counts["past_stuck"] += 1
            return True
        return False

    def _in_turn(self, ticket: _Ticket) -> bool:
        """Whether the order and the cap let ``ticket``'s call go (the lock is held)."""
        cap = self.max_in_flight
        if cap is not None and self._in_flight.get(ticket.replica, 0) >= cap:
            return False
        if not self.ordered:
            return True
        # Every earlier ticket of the replica has started (or finished): none is before it.
        queue = self._queues.get(ticket.replica, [])
        return bool(queue) and queue[0] is ticket

    def _stuck(self, replica: str) -> bool:
        """Whether a call out to ``replica`` has gone ``stuck_s`` without starting its answer
        (the lock is held): the oldest of its calls sent and not started, looked at alone."""
        unstarted = self._unstarted.get(replica)
        if not unstarted:
            return False
        return self._clock() - next(iter(unstarted.values())) > self.stuck_s

    def _drop_stale(self, replica: str) -> None:
        """Drop the tickets at the head of ``replica``'s queue whose call never came (the
        lock is held)."""
        queue = self._queues.get(replica, [])
        now = self._clock()
        dropped = False
        while queue and not queue[0].arrived and now - queue[0].issued > self.stale_s:
            ticket = queue.pop(0)
            self._tickets.pop(ticket.rid, None)
            self._counts["stale"] += 1
            dropped = True
        if dropped:
            self._wake()

    def _wake(self) -> None:
        """Every waiting call looks again (the lock is held)."""
        waiting, self._waiting = self._waiting, []
        for loop, future in waiting:
            # A closed event loop: nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
