"""A cancelled or timed-out async plan records no turn (the app never received it): the worker
thread cannot be stopped, so its turn is committed only once the coroutine has the plan; and a
planning window refuses an endless length."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from contextpilot_integrations import (
    ContextPilot,
    PlanningWindow,
    PlanRequest,
    ReplicaRouter,
    Scope,
)
from contextpilot_integrations.core import placements


def doc(i: int) -> str:
    return f"Document {i}: " + " ".join(f"word{i}_{j}" for j in range(60))


@pytest.fixture
def slow_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every planning call takes 0.2 s more to complete, so a 0.05 s ``wait_for`` cancels its
    caller while the worker thread is still planning."""
    finish = placements.PendingTurns.__exit__

    def finish_slowly(self: placements.PendingTurns, *exc: object) -> None:
        time.sleep(0.2)
        finish(self, *exc)

    monkeypatch.setattr(placements.PendingTurns, "__exit__", finish_slowly)


def planner_of(kind: str) -> ContextPilot | ReplicaRouter | PlanningWindow:
    if kind == "pilot":
        return ContextPilot()
    if kind == "router":
        return ReplicaRouter([{"name": "a"}, {"name": "b"}])
    return PlanningWindow(ContextPilot(), window_ms=1)


@pytest.mark.parametrize("kind", ["pilot", "router", "window"])
def test_a_cancelled_aplan_records_no_turn(kind: str, slow_planning: None) -> None:
    planner = planner_of(kind)

    async def main() -> object:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                planner.aplan("q1", [doc(1), doc(2)], scope=Scope("c")), timeout=0.05
            )
        await asyncio.sleep(0.6)  # the worker has finished meanwhile
        return await planner.aplan("q2", [doc(1), doc(2)], scope=Scope("c"))

    second = asyncio.run(main())
    # The app never received turn 1, so nothing may point at it: both documents in full.
    assert [p.status.value for p in second.placements] == ["shown", "shown"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["pilot", "router", "window"])
def test_a_completed_aplan_records_its_turn(kind: str) -> None:
    planner = planner_of(kind)

    async def main() -> object:
        await planner.aplan("q1", [doc(1)], scope=Scope("c"))
        return await planner.aplan("q2", [doc(1), doc(3)], scope=Scope("c"))

    second = asyncio.run(main())
    assert second.scope.turn == 2  # type: ignore[attr-defined]
    assert second.placements[0].status.value == "replaced"  # type: ignore[attr-defined]


def test_a_cancelled_aplan_batch_leaves_nothing_indexed(slow_planning: None) -> None:
    pilot = ContextPilot()
    batch = [PlanRequest("q", [doc(1)], "r1", Scope("c1")), PlanRequest("q", [doc(2)], "r2")]

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pilot.aplan_batch(batch), timeout=0.05)
        await asyncio.sleep(0.6)

    asyncio.run(main())
    assert "r1" not in pilot.index and "r2" not in pilot.index
    again = pilot.plan("q", [doc(1)], scope=Scope("c1"))  # its turn was never recorded
    assert again.placements[0].status.value == "shown"


@pytest.mark.parametrize("bad", [math.inf, -1.0, math.nan, "10", None, 1e9])
def test_the_window_refuses_an_endless_or_non_numeric_length(bad: object) -> None:
    with pytest.raises(ValueError, match="window_ms"):
        PlanningWindow(ContextPilot(), window_ms=bad)  # type: ignore[arg-type]
