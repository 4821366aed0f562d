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
:class:`~.window_policy.WindowPolicy`. The window's requests are planned as one batch and
released in its schedule order (a window of one is planned with ``plan``); ``window_ms=0`` plans
every request at once.

Threads (``plan``) and coroutines (``aplan``) may share one window; a coroutine never blocks its
event loop. A batch that fails (one bad or conflicting request) is planned again request by
request, so only the bad request's caller gets the error.
"""

from __future__ import annotations

import asyncio
import contextlib
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


class _Alone(Exception):
    """Marks a window of one request, planned with ``plan`` (not a failure)."""


_ALONE = _Alone()


class _Member:
    """One caller waiting for its plan: a thread (an event) or a coroutine (a future)."""

    __slots__ = ("done", "error", "future", "loop", "on_orphan", "plan", "request")

    def __init__(
        self,
        request: PlanRequest,
        loop: asyncio.AbstractEventLoop | None = None,
        on_orphan: Callable[[Plan], None] | None = None,
    ) -> None:
        self.request = request
        self.loop = loop
        self.on_orphan = on_orphan
        self.future: asyncio.Future[Plan] | None = loop.create_future() if loop else None
        self.done = threading.Event()
        self.plan: Plan | None = None
        self.error: BaseException | None = None

    def deliver(self, plan: Plan | None, error: BaseException | None) -> None:
        self.plan, self.error = plan, error
        self.done.set()
        if self.loop is not None and self.future is not None:
            self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        assert self.future is not None
        if self.future.done():
            if self.future.cancelled() and self.plan is not None and self.on_orphan is not None:
                # Its coroutine was cancelled: nobody shows this plan, so undo what it recorded.
                assert self.loop is not None
                self.loop.run_in_executor(None, self.on_orphan, self.plan)
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            assert self.plan is not None
            self.future.set_result(self.plan)

    def result(self) -> Plan:
        if self.error is not None:
            raise self.error
        assert self.plan is not None
        return self.plan


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

    Raises:
        TypeError: ``planner`` does not meet the ``Planner`` contract.
        ValueError: a ``window_ms`` that is not a number in [0, :data:`MAX_WINDOW_MS`], or a
            ``max_batch`` below 1.

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
    ) -> None:
        check_planner(planner, "planner")
        self.planner = planner
        if (
            isinstance(window_ms, bool)
            or not isinstance(window_ms, (int, float))
            or not 0 <= window_ms <= MAX_WINDOW_MS
        ):
            raise ValueError(
                f"window_ms must be a number of milliseconds in [0, {MAX_WINDOW_MS:g}], "
                f"got {window_ms!r}"
            )
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
        member = _Member(PlanRequest(query, blocks, rid, scope or NO_SCOPE))
        window, leader = self._join(member)
        if leader:
            self._lead(window)
        member.done.wait()
        return member.result()

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """:meth:`plan` for a coroutine: the event loop goes on while the window is open."""
        member = _Member(
            PlanRequest(query, blocks, rid, scope or NO_SCOPE),
            asyncio.get_running_loop(),
            self._undo_orphan,
        )
        window, leader = self._join(member)
        if leader:
            await self._alead(window)
        assert member.future is not None
        return await member.future

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
        ``closed_at_once`` (sparse traffic) and ``closed_at_half`` (nothing shared), and
        ``batch_failures`` (planned again one by one)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        out["mean_batch"] = out["requests"] / out["windows"] if out["windows"] else 0.0
        return out

    # ------------------------------------------------------------------ internals
    def _join(self, member: _Member) -> tuple[OpenWindow[_Member], bool]:
        """Add ``member`` to the open window (closing it first when it cannot join); returns
        the window and whether this caller leads it (waits, then plans it)."""
        request = member.request
        with self._lock:
            now = self._clock()
            self._rate.arrive(now)
            window = self._open
            if window is not None and not self.policy.admits(window, request):
                self._close(window)
                window = None
            if window is None:
                sparse = self._rate.expected(self.policy.window_s) < 1.0
                window = OpenWindow(now, sparse=sparse)
                self._open = window
                leader = True
            else:
                leader = False
            window.add(request, member, track_blocks=self.policy.adaptive)
            if len(window.members) >= self.policy.max_batch or self.policy.window_s == 0:
                self._close(window)
            return window, leader

    def _close(self, window: OpenWindow[_Member]) -> None:
        """Close ``window`` (the lock is held) and wake its leader."""
        if window.closed:
            return
        window.closed = True
        if self._open is window:
            self._open = None
        if window.wake is not None:
            window.wake()

    def _remaining(self, window: OpenWindow[_Member]) -> float | None:
        """Seconds until ``window`` closes; ``None`` once it is closed (the lock is held)."""
        if window.closed:
            return None
        left = self.policy.deadline(window) - self._clock()
        if left <= 0:
            closes = self.policy.deadline(window)
            if closes == window.opened and self.policy.window_s > 0:
                self._counts["closed_at_once"] += 1
            elif closes < window.opened + self.policy.window_s:
                self._counts["closed_at_half"] += 1
            self._close(window)
            return None
        return left

    def _lead(self, window: OpenWindow[_Member]) -> None:
        try:
            self._wait_and_plan(window)
        except BaseException as exc:  # never leave a member waiting for good
            self._fail_undelivered(window, exc)
            raise

    async def _alead(self, window: OpenWindow[_Member]) -> None:
        try:
            await self._await_and_plan(window)
        except BaseException as exc:
            self._fail_undelivered(window, exc)
            raise

    def _undo_orphan(self, plan: Plan) -> None:
        """A coroutine was cancelled before its plan arrived (``asyncio.wait_for`` timed out):
        the planner drops the request and forgets the conversation's records, so no later
        hint points at a turn the caller never received. Best effort (logged)."""
        try:
            self.planner.evict(plan.rid)
            forget = getattr(self.planner, "forget_conversation", None)
            if plan.scope.conversation_id is not None and forget is not None:
                forget(plan.scope.conversation_id, plan.scope.tenant)
        except Exception:
            logger.warning("could not undo the cancelled request %s", plan.rid, exc_info=True)

    @staticmethod
    def _fail_undelivered(window: OpenWindow[_Member], error: BaseException) -> None:
        for member in window.members:
            if not member.done.is_set():
                member.deliver(None, error)

    def _wait_and_plan(self, window: OpenWindow[_Member]) -> None:
        wakeup = threading.Event()
        with self._lock:
            window.wake = wakeup.set
        while True:
            with self._lock:
                left = self._remaining(window)
            if left is None:
                break
            wakeup.wait(left)
            wakeup.clear()
        requests = [member.request for member in window.members]
        if len(requests) == 1:  # exactly what the planner alone does
            self._release(window, _ALONE, None, [self._plan_one(requests[0])])
            return
        try:
            outcome: BatchPlan | BaseException = self.planner.plan_batch(requests)
        except Exception as exc:  # planned again one by one below
            outcome = exc
        self._release(window, outcome, lambda request: self._plan_one(request))

    async def _await_and_plan(self, window: OpenWindow[_Member]) -> None:
        loop = asyncio.get_running_loop()
        wakeup = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(wakeup.set)

        with self._lock:
            window.wake = wake
        while True:
            with self._lock:
                left = self._remaining(window)
            if left is None:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wakeup.wait(), left)
            wakeup.clear()
        requests = [member.request for member in window.members]
        if len(requests) == 1:  # exactly what the planner alone does
            self._release(window, _ALONE, None, [await self._aplan_one(requests[0])])
            return
        try:
            outcome: BatchPlan | BaseException = await self.planner.aplan_batch(requests)
        except Exception as exc:
            outcome = exc
        if isinstance(outcome, BaseException):
            singles = [await self._aplan_one(m.request) for m in window.members]
            self._release(window, outcome, None, singles)
        else:
            self._release(window, outcome, None)

    def _plan_one(self, request: PlanRequest) -> tuple[Plan | None, BaseException | None]:
        try:
            return self.planner.plan(
                request.query, request.blocks, rid=request.rid, scope=request.scope
            ), None
        except Exception as exc:
            return None, exc

    async def _aplan_one(self, request: PlanRequest) -> tuple[Plan | None, BaseException | None]:
        try:
            plan = await self.planner.aplan(
                request.query, request.blocks, rid=request.rid, scope=request.scope
            )
            return plan, None
        except Exception as exc:
            return None, exc

    def _release(
        self,
        window: OpenWindow[_Member],
        outcome: BatchPlan | BaseException,
        plan_one: Callable[[PlanRequest], tuple[Plan | None, BaseException | None]] | None,
        singles: list[tuple[Plan | None, BaseException | None]] | None = None,
    ) -> None:
        """Hand every member its plan, in the batch's schedule order; after a failed batch,
        each member's own plan (or error)."""
        members = window.members
        with self._lock:
            self._counts["windows"] += 1
            self._counts["requests"] += len(members)
            if isinstance(outcome, BaseException) and outcome is not _ALONE:
                self._counts["batch_failures"] += 1
        if isinstance(outcome, BaseException):
            if singles is None:
                assert plan_one is not None
                singles = [plan_one(member.request) for member in members]
            for member, (plan, error) in zip(members, singles):
                member.deliver(plan, error)
            return
        for index in outcome.schedule:
            members[index].deliver(outcome.plans[index], None)
