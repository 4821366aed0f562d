"""Explicit request ids held for the planning call that names them.

Two concurrent calls must never plan the same rid: the loser would otherwise fail only after
its conversation turn was recorded. A call holds its explicit rids for its whole run; a rid
already indexed, or held by another call, is refused before anything is planned.

Public API: :class:`RidReservations`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Container, Iterator, Sequence

from contextpilot_integrations.core.request import RidConflictError

__all__ = ["RidReservations"]

_NOTHING_HELD = contextlib.nullcontext()  # stateless: one serves every call with no rid


class RidReservations:
    """The rids the running calls hold. Thread-safe."""

    def __init__(self) -> None:
        self._planning: set[str] = set()
        self._lock = threading.Lock()

    def hold(
        self, rids: Sequence[str], indexed: Container[str]
    ) -> contextlib.AbstractContextManager[None]:
        """Hold ``rids`` for the ``with`` block (none: nothing is checked or held).

        Raises:
            RidConflictError: a rid is held by a concurrent call, or is in ``indexed``.
        """
        return self._held(rids, indexed) if rids else _NOTHING_HELD

    @contextlib.contextmanager
    def _held(self, rids: Sequence[str], indexed: Container[str]) -> Iterator[None]:
        with self._lock:
            busy = next((rid for rid in rids if rid in self._planning), None)
            if busy is not None:
                raise RidConflictError(f"rid {busy!r} is being planned by a concurrent call")
            already = next((rid for rid in rids if rid in indexed), None)
            if already is not None:
                raise RidConflictError(f"rid {already!r} is already indexed")
            self._planning.update(rids)
        try:
            yield
        finally:
            with self._lock:
                self._planning.difference_update(rids)
