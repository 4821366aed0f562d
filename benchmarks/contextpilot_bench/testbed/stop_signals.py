"""Ctrl-C and SIGTERM while a real engine runs, made reliable, so that it is always stopped
(``contextpilot-bench`` around a whole run, ``python -m contextpilot_bench.testbed serve``).

The handlers are installed whatever the signals' disposition was at start: a background job of a
non-interactive shell starts with SIGINT ignored, and must still stop its engine on Ctrl-C's
signal.

The first signal raises ``KeyboardInterrupt`` (SIGINT) or :class:`Terminated` (SIGTERM) at
once. Python reports an exception raised while a generator is being finalised as "ignored"
(httpx's streaming generators are closed that way), so that raise can be lost; the signal is
therefore also recorded, and :meth:`StopSignals.check`, called before every request, raises
again. Later signals are only recorded, so that stopping the engine is not cut short.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["StopSignals", "Terminated"]


class Terminated(BaseException):
    """SIGTERM arrived during a run: unwind (like KeyboardInterrupt) so the engine is stopped."""


class StopSignals:
    """SIGINT and SIGTERM handlers for the duration of a ``with`` block (installed in the main
    thread only; elsewhere a no-op). ``signum`` is the first signal received, if any."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` or :class:`Terminated` if a stop signal arrived."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is not None:
            raise Terminated

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        self.signum = signum
        if first:
            self.check()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
