"""The planner contract every adapter plans through, with sync and async twins.

Met by the in-process :class:`~contextpilot_integrations.core.pilot.ContextPilot` and by the
index service's client (:class:`~contextpilot_integrations.client.client.ContextPilotClient`),
so the LangChain, LlamaIndex and Mem0 adapters take either: one shared context index per
process, or one per fleet. Sync callers use ``plan`` / ``plan_batch``; coroutines await
``aplan`` / ``aplan_batch``, which never block the event loop (the in-process pilot plans in a
worker thread, the client sends over an async transport).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from contextpilot_integrations.core.plan import BatchPlan, Plan
    from contextpilot_integrations.core.rendering import PromptLayout
    from contextpilot_integrations.core.request import PlanRequest, Scope

__all__ = ["PLANNER_MEMBERS", "Planner", "ThreadedAsyncTwins", "check_planner"]

PLANNER_MEMBERS = ("layout", "plan", "aplan", "plan_batch", "aplan_batch", "evict")
"""The members of :class:`Planner`."""

_SYNC = ("plan", "plan_batch", "evict")
_Planned = TypeVar("_Planned")
_ASYNC = ("aplan", "aplan_batch")


@runtime_checkable
class Planner(Protocol):
    """Plans requests against a context index.

    ``plan(query, blocks, rid=..., scope=...)`` plans one request (a
    :class:`~contextpilot_integrations.core.request.PlanRequest` built from its arguments);
    ``plan_batch(requests)`` orders a list of requests jointly and schedules them. Both raise
    ``TypeError`` / ``ValueError`` for bad input, naming the field and the value.
    """

    @property
    def layout(self) -> PromptLayout:
        """The layout plans are rendered with."""
        ...

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan: ...

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan: ...

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan: ...

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan: ...

    def evict(self, rid: str) -> bool: ...


def check_planner(pilot: object, name: str = "pilot") -> None:
    """Raise unless ``pilot`` meets the :class:`Planner` contract: every member present,
    ``plan`` / ``plan_batch`` / ``evict`` plain methods, ``aplan`` / ``aplan_batch`` coroutine
    functions (a sync-only object, or one whose ``plan`` returns a coroutine, is refused here
    rather than failing at the first call).

    Looked up statically (``inspect.getattr_static``), not with ``isinstance(pilot, Planner)``:
    on Python 3.11 that evaluates properties, and a service client's ``layout`` may be a
    network call.

    Raises:
        TypeError: naming ``name``, the type and the members that are missing or wrong.
    """
    problems: list[str] = []
    for member in PLANNER_MEMBERS:
        found = inspect.getattr_static(pilot, member, None)
        if found is None:
            problems.append(f"no {member}")
            continue
        function = getattr(found, "__func__", found)
        if member in _ASYNC and not inspect.iscoroutinefunction(function):
            problems.append(f"{member} is not a coroutine function")
        elif member in _SYNC and inspect.iscoroutinefunction(function):
            problems.append(f"{member} is a coroutine function (use a{member})")
    if problems:
        raise TypeError(
            f"{name} must implement the Planner protocol (ContextPilot or ContextPilotClient); "
            f"{type(pilot).__name__} has {', '.join(problems)}"
        )


class ThreadedAsyncTwins:
    """The async twins of an in-process planner: ``aplan`` and ``aplan_batch`` run its blocking
    ``plan`` and ``plan_batch`` in a worker thread (``asyncio.to_thread``), so the event loop
    goes on meanwhile. A base class of :class:`~.pilot.ContextPilot` and
    :class:`~.routing.ReplicaRouter`; the subclass provides ``plan``, ``plan_batch`` and
    ``evict``.

    Cancellation (``asyncio.wait_for`` timing out, a task cancelled) cannot stop the worker
    thread, so the conversation turns it plans are committed only once the coroutine has the
    plan, on its event loop (:class:`~.placements.DeferredTurns`); a cancelled call's turns are
    aborted and its requests evicted when the worker ends, so no later hint points at a turn
    the caller never received."""

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        raise NotImplementedError

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        raise NotImplementedError

    def evict(self, rid: str) -> bool:
        raise NotImplementedError

    async def aplan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        """:meth:`plan` in a worker thread, so the event loop goes on meanwhile."""
        return await self._in_thread(lambda: self.plan(query, blocks, rid=rid, scope=scope))

    async def aplan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        """:meth:`plan_batch` in a worker thread."""
        return await self._in_thread(lambda: self.plan_batch(requests))

    async def _in_thread(self, call: Callable[[], _Planned]) -> _Planned:
        from contextpilot_integrations.core.placements import DeferredTurns

        deferred = DeferredTurns()

        def run() -> _Planned:
            with deferred.collecting():
                return call()

        worker = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            result = await asyncio.shield(worker)
        except asyncio.CancelledError:
            worker.add_done_callback(lambda done: self._undo_cancelled(done, deferred))
            raise
        deferred.commit()
        return result

    def _undo_cancelled(self, done: asyncio.Future[Any], deferred: Any) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # the call failed: it recorded nothing
        deferred.abort()
        result = done.result()
        for plan in getattr(result, "plans", (result,)):
            self.evict(plan.rid)
