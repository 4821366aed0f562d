"""A planning window: requests that arrive close together are planned jointly.

LangChain and LlamaIndex call a retriever one request at a time, so a web app plans each request
alone (the online figures), while a batch planned jointly (:meth:`ContextPilot.plan_batch`) gets
the offline ones. :class:`PlanningWindow` sits in front of any planner and meets the same
:class:`~.planner_protocol.Planner` contract, so a face takes it unchanged::

    pilot = PlanningWindow(ContextPilot(), window_ms=10)
    retriever = ContextPilotRetriever(base_retriever=bm25, pilot=pilot)

A request opens a window or joins the open one; the window closes when it is ``window_ms`` old,
holds ``max_batch`` requests, or a request of a conversation already in it arrives (that request
opens the next window). With ``adaptive`` it closes earlier where waiting cannot pay: at once
when the recent arrival rate predicts no other request within the window, at half its length if
no two of its requests share a block yet. The rule, in virtual time:
:class:`~.window_policy.WindowPolicy`. With ``hold``, a window whose time is up stays open while
``hold()`` says that what it plans for is busy (the proxy's replicas all have calls waiting at
their door: a call planned now would wait there anyway), at most ``max_hold_ms`` past its
length; it still closes at ``max_batch`` requests or a second turn of a conversation in it.
The window's requests are planned as one batch and released in its schedule order (a window of
one is planned with ``plan``); ``window_ms=0`` plans every request at once.

Threads (``plan``) and coroutines (``aplan``) may share one window; a coroutine never blocks its
event loop. A window that stays open waits, and is planned with the planner's ``plan_batch``, in
a thread of its own that no caller runs: one caller's cancellation or timeout never fails,
delays or changes another's plan (docs/DESIGN.md, "Callers independent"). A caller that gives up
while the window is open leaves it; one that gives up while its window is being planned gets its
``CancelledError`` and has its plan undone (the request evicted, the conversation's records
forgotten: no later hint points at a turn it never received). A batch that fails (one bad or
conflicting request) goes back to its callers, each planning its own request, so only the bad
request's caller gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.planner_protocol import Planner, check_planner
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import NO_SCOPE, PlanRequest, Scope, check_batch
from contextpilot_integrations.core.window.window_policy import (
    ArrivalRate,
    OpenWindow,
    WindowPolicy,
)

__all__ = ["PlanningWindow"]

logger = logging.getLogger(__name__)

MAX_WINDOW_MS = 60_000.0
"""The longest planning window (one minute): a window is a short wait for requests arriving
together, and an unbounded one (``inf``) would never close."""

WINDOW_THREAD_NAME = "contextpilot-planning-window"
"""The name of the thread each window waits and is planned in."""

UNDO_THREAD_NAME = "contextpilot-planning-window-undo"
"""The name of the threads that undo a plan its caller gave up on."""

HOLD_POLL_S = 0.005
"""Seconds between two looks at ``hold()`` while a window is held past its length: the delay
between the busy end and the window's close."""


class _Member:
    """One caller waiting for its outcome: a thread (an event) or a coroutine (a future).

    The outcome is its plan, its error, or ``alone``: the caller plans its request itself, with
    the planner's ``plan`` / ``aplan`` (a window left with one request, or a batch that failed).
    A caller that gives up once its request was taken for planning (a cancelled coroutine, a
    thread interrupted while waiting) has the plan it never received undone (``on_orphan``),
    whether the plan reached it before it gave up or arrives after; so does one whose event
    loop has closed.
    """

    __slots__ = (
        "abandoned",
        "alone",
        "done",
        "error",
        "future",
        "lock",
        "loop",
        "on_orphan",
        "plan",
        "request",
        "undone",
        "window",
    )

    def __init__(
        self,
        request: PlanRequest,
        on_orphan: Callable[[Plan], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.request = request
        self.loop = loop
        self.on_orphan = on_orphan
        # The coroutine's future: its plan, or None for "plan it yourself".
        self.future: asyncio.Future[Plan | None] | None = loop.create_future() if loop else None
        self.done = threading.Event()
        self.lock = threading.Lock()  # the outcome arriving against the caller giving up
        self.plan: Plan | None = None
        self.error: BaseException | None = None
        self.alone = False
        self.abandoned = False
        self.undone = False
        self.window: OpenWindow[_Member] | None = None

    def deliver(self, plan: Plan | None, error: BaseException | None) -> None:
        """Hand the caller its plan or its error (from the window's thread)."""
        self._settle(plan, error, alone=False)

    def hand_back(self) -> None:
        """Let the caller plan its request itself (from the window's thread)."""
        self._settle(None, None, alone=True)

    def abandon(self) -> None:
        """The caller gives up after its request was taken for planning, without taking its
        outcome: a plan that has reached it is undone now, one still to come when it comes."""
        with self.lock:
            self.abandoned = True
            orphan = self._orphan()
        if orphan is not None:
            self._undo(orphan)

    def result(self) -> Plan:
        """A thread caller's plan, once settled (not ``alone``)."""
        if self.error is not None:
            raise self.error
        assert self.plan is not None
        return self.plan

    def _settle(self, plan: Plan | None, error: BaseException | None, *, alone: bool) -> None:
        with self.lock:
            self.plan, self.error, self.alone = plan, error, alone
            self.done.set()
            orphan = self._orphan() if self.abandoned else None
        if self.abandoned:
            if orphan is not None:
                self._undo(orphan)
            return
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:  # its event loop is closed: nobody awaits this plan any more
            self.abandon()

    def _resolve(self) -> None:
        """On the coroutine's event loop: its outcome, unless it was cancelled meanwhile (its
        ``abandon`` then undoes the plan)."""
        assert self.future is not None
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(None if self.alone else self.plan)

    def _orphan(self) -> Plan | None:
        """The plan to undo, once (the lock is held): one that arrived for a caller that gave
        up."""
        if self.undone or not self.done.is_set() or self.alone or self.plan is None:
            return None
        self.undone = True
        return self.plan

    def _undo(self, plan: Plan) -> None:
        """Undo ``plan`` off the caller's event loop (the undo may be a network call) and off
        the window's thread (the next callers' plans wait for it)."""
        threading.Thread(
            target=self.on_orphan, args=(plan,), name=UNDO_THREAD_NAME, daemon=True
        ).start()


class PlanningWindow:
    """Plans requests arriving within ``window_ms`` of each other as one batch.

    Args:
        planner: the planner to plan with (``ContextPilot``, ``ContextPilotClient``).
        window_ms: how long the first request of a window waits for others (milliseconds);
            0 plans every request at once.
        max_batch: most requests in one window.
        adaptive: close a window at half its length when no two of its requests share a
            block (module docstring).
        clock: monotonic seconds (injectable for tests).
        on_handed: called with each plan of a batch, in the batch's schedule order, just
            before the plans are handed to their callers (in the window's thread; a caller
            that resumes later than another still had its plan first). An error it raises is
            logged and the plans are handed out all the same.
        hold: whether what the window plans for is busy now (called under the window's lock,
            so it must be quick and must not plan): while it returns True a window whose time
            is up stays open, looked at again every :data:`HOLD_POLL_S`. An error it raises is
            logged once and counts as False.
        max_hold_ms: the most a window is held past its length (milliseconds, in [0,
            :data:`MAX_WINDOW_MS`]); 0 holds nothing.

    Raises:
        TypeError: ``planner`` does not meet the ``Planner`` contract, or ``hold`` is not
            callable.
        ValueError: a ``window_ms`` or ``max_hold_ms`` that is not a number in [0,
            :data:`MAX_WINDOW_MS`], or a ``max_batch`` below 1.

    Thread-safe; meets the ``Planner`` contract (``plan_batch`` passes straight through: a
    batch is planned jointly already).
    """

    def __init__(
        self,
        planner: Planner,
        *,
        window_ms: float = 10.0,
        max_batch: int = 64,
        adaptive: bool = True,
        clock: Callable[[], float] = time.monotonic,
        on_handed: Callable[[Plan], None] | None = None,
        hold: Callable[[], bool] | None = None,
        max_hold_ms: float = 0.0,
    ) -> None:
        check_planner(planner, "planner")
        self._on_handed = on_handed
        self.planner = planner
        for name, value in (("window_ms", window_ms), ("max_hold_ms", max_hold_ms)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value <= MAX_WINDOW_MS
            ):
                raise ValueError(
                    f"{name} must be a number of milliseconds in [0, {MAX_WINDOW_MS:g}], "
                    f"got {value!r}"
                )
        if hold is not None and not callable(hold):
            raise TypeError(f"hold must be callable or None, got {type(hold).__name__}")
        self._hold = hold if max_hold_ms > 0 else None
        self._max_hold_s = max_hold_ms / 1000.0
        self._hold_failed = False
        self.policy = WindowPolicy(window_ms / 1000.0, max_batch, adaptive)
        self._clock = clock
        self._lock = threading.Lock()
        self._open: OpenWindow[_Member] | None = None
        self._rate = ArrivalRate()
        self._counts = {
            "windows": 0,
            "requests": 0,
            "closed_at_once": 0,
            "closed_at_half": 0,
            "batch_failures": 0,
            "held": 0,
            "held_ms": 0.0,
        }

    @property
    def layout(self) -> PromptLayout:
        """The planner's layout."""
        return self.planner.layout

    # ------------------------------------------------------------------ Public API
    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """Wait for the window, then return this request's plan (as ``ContextPilot.plan``).

        Raises:
            TypeError / ValueError / RidConflictError: as the planner's ``plan``.
        """
        request = PlanRequest(query, blocks, rid, scope or NO_SCOPE)
        member = _Member(request, self._undo_orphan)
        if not self._join(member):
            try:
                member.done.wait()
            except BaseException:  # interrupted while waiting (Ctrl-C): the others go on
                if not self._withdraw(member):
                    member.abandon()
                raise
            if not member.alone:
                return member.result()
        return self.planner.plan(query, blocks, rid=rid, scope=scope)

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """:meth:`plan` for a coroutine: the event loop goes on while the window is open.

        Cancelling it (a task cancelled, ``asyncio.wait_for`` timing out) affects this call
        alone: its request leaves the window if the window is not planned yet, and a plan made
        for it meanwhile is undone (the request evicted, its conversation forgotten); every
        other caller of the window gets its plan all the same.
        """
        request = PlanRequest(query, blocks, rid, scope or NO_SCOPE)
        member = _Member(request, self._undo_orphan, asyncio.get_running_loop())
        if not self._join(member):
            assert member.future is not None
            try:
                plan = await member.future
            except asyncio.CancelledError:
                if not self._withdraw(member):
                    member.abandon()
                raise
            if plan is not None:
                return plan
        return await self.planner.aplan(query, blocks, rid=rid, scope=scope)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """The planner's ``plan_batch`` (a batch is already planned jointly)."""
        return self.planner.plan_batch(check_batch(requests))

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """The planner's ``aplan_batch``."""
        return await self.planner.aplan_batch(check_batch(requests))

    def evict(self, rid: str) -> bool:
        """The planner's ``evict``."""
        return self.planner.evict(rid)

    def stats(self) -> dict[str, Any]:
        """``windows`` closed, ``requests`` planned through them, ``mean_batch``, adaptive
        ``closed_at_once`` (sparse traffic) and ``closed_at_half`` (nothing shared),
        ``batch_failures`` (planned again one by one), and the windows ``held`` past their
        time by ``hold`` with the milliseconds they were held in all (``held_ms``)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        out["mean_batch"] = out["requests"] / out["windows"] if out["windows"] else 0.0
        return out

    # ------------------------------------------------------------------ internals
    def _join(self, member: _Member) -> bool:
        """Add ``member`` to the open window (closing it first when it cannot join), or open a
        window, with its own thread, for it. True when the caller plans its request itself at
        once: the window it opened closed at once with it alone (``window_ms=0``,
        ``max_batch=1``, sparse traffic)."""
        request = member.request
        with self._lock:
            now = self._clock()
            self._rate.arrive(now)
            window = self._open
            if window is not None and not self.policy.admits(window, request):
                self._close(window)
                window = None
            opens = window is None
            if window is None:
                sparse = self._rate.expected(self.policy.window_s) < 1.0
                window = OpenWindow(now, sparse=sparse)
                self._open = window
            window.add(request, member, track_blocks=self.policy.adaptive)
            member.window = window
            if len(window.members) >= self.policy.max_batch or self.policy.window_s == 0:
                self._close(window)
            if not opens:
                return False
            if self._remaining(window) is None:  # closed as it opened: no one else is in it
                window.planning = True
                self._counts["windows"] += 1
                self._counts["requests"] += 1
                return True
            wakeup = threading.Event()
            window.wake = wakeup.set
        thread = threading.Thread(
            target=self._run, args=(window, wakeup), name=WINDOW_THREAD_NAME, daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to spare: each caller plans its own request
            with self._lock:
                self._close(window)
                window.planning = True
                members = list(window.members)
            for waiting in members:
                waiting.hand_back()
        return False

    def _withdraw(self, member: _Member) -> bool:
        """Take a caller that gives up out of its window; True when it was still waiting for
        the window to be planned (nothing is planned for it then), False once its request was
        taken for planning."""
        window = member.window
        with self._lock:
            if window is None or window.planning or member not in window.members:
                return False
            window.remove(member, member.request)
            if not window.members:
                self._close(window)  # nobody left: its thread ends
            return True

    def _close(self, window: OpenWindow[_Member]) -> None:
        """Close ``window`` (the lock is held) and wake its thread."""
        if window.closed:
            return
        window.closed = True
        if window.held_since is not None:
            self._counts["held"] += 1
            self._counts["held_ms"] += (self._clock() - window.held_since) * 1000.0
        if self._open is window:
            self._open = None
        if window.wake is not None:
            window.wake()

    def _remaining(self, window: OpenWindow[_Member]) -> float | None:
        """Seconds until ``window`` closes; ``None`` once it is closed (the lock is held)."""
        if window.closed:
            return None
        now = self._clock()
        left = self.policy.deadline(window) - now
        if left <= 0:
            held = self._held(window, now)
            if held is not None:
                return held
            closes = self.policy.deadline(window)
            if closes == window.opened and self.policy.window_s > 0:
                self._counts["closed_at_once"] += 1
            elif closes < window.opened + self.policy.window_s:
                self._counts["closed_at_half"] += 1
            self._close(window)
            return None
        return left

    def _held(self, window: OpenWindow[_Member], now: float) -> float | None:
        """Seconds to wait before looking again when ``window``, whose time is up, is held
        open by ``hold``; ``None`` when it closes now (the lock is held). Every window's hold
        is counted from the end of its full length, whatever the adaptive rule made its
        deadline."""
        if self._hold is None:
            return None
        until = window.opened + self.policy.window_s + self._max_hold_s
        if now >= until:
            return None
        try:
            busy = bool(self._hold())
        except Exception:
            if not self._hold_failed:
                self._hold_failed = True
                logger.exception("the planning window's hold failed: windows close on time")
            busy = False
        if not busy:
            return None
        if window.held_since is None:
            window.held_since = now
        return min(HOLD_POLL_S, until - now)

    def _run(self, window: OpenWindow[_Member], wakeup: threading.Event) -> None:
        """The window's thread: wait until the window closes, then plan its requests. No
        caller runs this, so no caller's cancellation or timeout can stop it."""
        while True:
            with self._lock:
                left = self._remaining(window)
                if left is None:
                    window.planning = True  # its members are fixed from here on
                    members = list(window.members)
                    break
            wakeup.wait(left)
            wakeup.clear()
        try:
            self._plan_members(members)
        except BaseException as exc:  # never leave a caller waiting for good: it gets the error
            for member in members:
                if not member.done.is_set():
                    member.deliver(None, exc)

    def _plan_members(self, members: list[_Member]) -> None:
        """Plan one closed window's requests as a batch and hand each caller its plan, in the
        batch's schedule order. A window left with one request (the others gave up), and
        every request of a batch that failed, go back to their callers to plan alone, so only
        a bad request's caller gets its error."""
        if not members:
            return
        with self._lock:
            self._counts["windows"] += 1
            self._counts["requests"] += len(members)
        if len(members) == 1:  # exactly what the planner alone does
            members[0].hand_back()
            return
        try:
            batch = self.planner.plan_batch([member.request for member in members])
        except Exception:
            with self._lock:
                self._counts["batch_failures"] += 1
            for member in members:
                member.hand_back()
            return
        if self._on_handed is not None:
            for index in batch.schedule:
                try:
                    self._on_handed(batch.plans[index])
                except Exception:
                    logger.exception("on_handed failed for %s", batch.plans[index].rid)
        for index in batch.schedule:
            members[index].deliver(batch.plans[index], None)

    def _undo_orphan(self, plan: Plan) -> None:
        """A caller gave up (a cancelled coroutine, ``asyncio.wait_for`` timed out) after its
        request was planned: the planner drops the request and forgets the conversation's
        records, so no later hint points at a turn the caller never received. Best effort
        (logged)."""
        try:
            self.planner.evict(plan.rid)
            forget = getattr(self.planner, "forget_conversation", None)
            if plan.scope.conversation_id is not None and forget is not None:
                forget(plan.scope.conversation_id, plan.scope.tenant)
        except Exception:
            logger.warning("could not undo the cancelled request %s", plan.rid, exc_info=True)
