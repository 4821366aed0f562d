"""Cancelling the running asyncio task from a callback (a client's disconnect, a deadline),
and telling that cancellation from any other (docs/DESIGN.md, "The proxy").

The proxy's hot path watches each call's client and deadline with one plain asyncio task or
timer, not an anyio task group or cancel scope: those cost a good part of the event loop's
own work per call. :class:`TaskCancel` is what ``asyncio.timeout`` does, for Python 3.10 too.
"""

from __future__ import annotations

import asyncio

__all__ = ["TaskCancel", "raise_failure"]


class TaskCancel:
    """Cancels the task running when it was made, once, on :meth:`cancel`.

    In an ``except asyncio.CancelledError`` around the awaits it may cut short,
    :meth:`caught` says whether the cancellation is this one's (swallow it) or another's
    (re-raise it): on Python 3.11 and later the task's own count of cancellations asked says
    so; on 3.10, which keeps none, a cancellation that comes with this one is taken as this
    one.
    """

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("TaskCancel needs a running asyncio task")
        self._task = task
        self.fired = False
        """Whether :meth:`cancel` was called."""

    def cancel(self) -> None:
        """Cancel the task (again: nothing)."""
        if not self.fired:
            self.fired = True
            self._task.cancel()

    def caught(self) -> bool:
        """In an ``except asyncio.CancelledError``: whether it is this one's cancellation,
        which the task then no longer counts."""
        if not self.fired:
            return False
        uncancel = getattr(self._task, "uncancel", None)
        return uncancel is None or uncancel() == 0


def raise_failure(task: asyncio.Task[None]) -> None:
    """Raise what a side task (a watcher) that has ended failed with, as a task group would:
    its failure is never lost (nothing, while it runs or when it ended otherwise)."""
    if task.done() and not task.cancelled():
        failure = task.exception()
        if failure is not None:
            raise failure
