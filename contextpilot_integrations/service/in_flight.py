"""The plans in flight at the service, so a forget waits for those that arrived before it.

A client that gives up on a plan it sent (a cancelled call, a timeout) forgets the
conversation on the service before its next call (:mod:`contextpilot_integrations.client.
conversations`). The service may still hold that plan: waiting in a planning window, being
planned, or (the client gone) planned for nobody; its turn would then be recorded after the
forget, and the client's next plan could hint at a turn it never received (docs/DESIGN.md,
"Sure hints"). So each plan takes a ticket when its HTTP request arrives (before its body is
read: the conversation is not known yet), names its conversations once its body is read, and
gives the ticket back when its plan is made; a forget of a conversation first waits for every
ticket taken before it that names that conversation or names none yet. Tickets taken after the
forget began are not waited for, so a busy conversation cannot hold a forget up.

Bounded (docs/DESIGN.md, "Bounded"): one entry per plan in flight; a forget waits at most
``timeout_s`` (a plan stuck that long is logged, and the forget goes on). Thread-safe: one
condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["PlansInFlight"]

logger = logging.getLogger(__name__)

ConversationKey = tuple[str, str]
"""``(tenant, conversation_id)``, the conversation store's key."""


class PlansInFlight:
    """Tickets of the plans in flight and the conversations they plan.

    Args:
        timeout_s: the longest a forget waits for the plans that arrived before it (seconds).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._changed = threading.Condition()
        self._next = 0
        # ticket -> the conversations its plan records turns of (None: its body is not read)
        self._tickets: dict[int, frozenset[ConversationKey] | None] = {}

    def arrive(self) -> int:
        """A plan's request arrived: its ticket (for :meth:`planning`; the request's handler
        calls :meth:`done_reading` when it ends)."""
        with self._changed:
            ticket = self._next
            self._next += 1
            self._tickets[ticket] = None
            return ticket

    def done_reading(self, ticket: int) -> None:
        """The handler of ``ticket``'s request ends: give the ticket back unless its plan
        named its conversations (:meth:`planning` gives it back then, also when the handler
        stopped waiting for it: a plan abandoned by a cancelled handler still records)."""
        with self._changed:
            if ticket in self._tickets and self._tickets[ticket] is None:
                del self._tickets[ticket]
                self._changed.notify_all()

    @contextmanager
    def planning(
        self, conversations: Iterable[ConversationKey], ticket: int | None = None
    ) -> Iterator[None]:
        """While the block runs, the plan of ``ticket`` (a new one when ``None``: a call that
        did not come over HTTP) records turns of ``conversations``; the ticket is given back
        when the block ends."""
        keys = frozenset(conversations)
        with self._changed:
            if ticket is None:
                ticket = self._next
                self._next += 1
            self._tickets[ticket] = keys
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._tickets.pop(ticket, None)
                self._changed.notify_all()

    def wait_before_forget(self, conversation: ConversationKey) -> bool:
        """Wait until every plan that arrived before this call and may record a turn of
        ``conversation`` is made; False when some were still running after ``timeout_s``
        (logged at warning level)."""
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            mark = self._next

            def earlier() -> bool:
                return any(
                    ticket < mark and (keys is None or conversation in keys)
                    for ticket, keys in self._tickets.items()
                )

            while earlier():
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning(
                        "forgetting conversation %.80r while plans of it that arrived before "
                        "still run (more than %g s)",
                        conversation[1],
                        self.timeout_s,
                    )
                    return False
                self._changed.wait(left)
        return True
