"""The planning window: concurrent requests planned jointly, released in schedule order."""

from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

import pytest

from contextpilot_integrations import ContextPilot, PlanRequest, RidConflictError, Scope
from contextpilot_integrations.core.planner_protocol import check_planner
from contextpilot_integrations.core.planning_window import PlanningWindow, WindowPolicy, _Member

SHARED = [f"shared passage {i}: " + "common words " * 30 for i in range(3)]


def _own(i: int) -> str:
    return f"own passage {i}: " + f"words of request {i} " * 20


class CountingPilot(ContextPilot):
    """Records the batches the window sends."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.singles = 0

    def plan_batch(self, requests):  # type: ignore[no-untyped-def]
        self.batches.append(len(requests))
        return super().plan_batch(requests)

    def plan(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.singles += 1
        return super().plan(*args, **kwargs)


def _in_threads(window: PlanningWindow, requests: list[tuple[str, list[str], dict]]) -> list:
    results: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def run(i: int) -> None:
        query, blocks, kwargs = requests[i]
        barrier.wait()
        try:
            results[i] = window.plan(query, blocks, **kwargs)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_concurrent_threads_are_planned_as_one_batch_and_share_a_prefix() -> None:
    pilot = CountingPilot()
    window = PlanningWindow(pilot, window_ms=200, adaptive=False)
    check_planner(window)
    requests = [(f"q{i}", [_own(i), *reversed(SHARED)], {}) for i in range(6)]
    plans = _in_threads(window, requests)
    assert pilot.batches == [6] and pilot.singles == 0
    prefixes = {tuple(b.text for b in plan.blocks[:3]) for plan in plans}
    assert len(prefixes) == 1 and set(next(iter(prefixes))) == set(SHARED)  # jointly aligned
    assert window.stats()["windows"] == 1 and window.stats()["mean_batch"] == 6


def test_coroutines_and_threads_share_windows_and_the_loop_is_never_blocked() -> None:
    pilot = CountingPilot()
    window = PlanningWindow(pilot, window_ms=150, adaptive=False)
    ticks: list[float] = []

    async def ticker() -> None:
        for _ in range(10):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def main() -> list:
        thread_result: list = []
        thread = threading.Thread(
            target=lambda: thread_result.append(window.plan("t", [_own(9), *SHARED]))
        )
        thread.start()
        plans = await asyncio.gather(
            *(window.aplan(f"a{i}", [_own(i), *SHARED]) for i in range(4)), ticker()
        )
        await asyncio.to_thread(thread.join)
        return [*plans[:4], *thread_result]

    plans = asyncio.run(main())
    assert len(plans) == 5 and sum(pilot.batches) == 5 and len(pilot.batches) <= 2
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.1  # the loop kept ticking while the window was open


def test_a_second_turn_of_a_conversation_goes_to_the_next_window() -> None:
    pilot = CountingPilot()
    window = PlanningWindow(pilot, window_ms=300, adaptive=False)
    requests = [
        ("q0", [_own(0), *SHARED], {"scope": Scope("c")}),
        ("q1", [_own(1), *SHARED], {"scope": Scope("c")}),
        ("q2", [_own(2), *SHARED], {"scope": Scope("d")}),
    ]
    plans = _in_threads(window, requests)
    assert all(not isinstance(p, Exception) for p in plans), plans
    assert sorted(pilot.batches) in ([1, 2], [1, 1, 1])
    assert sorted(p.scope.turn for p in plans[:2]) == [1, 2]


def test_a_bad_request_fails_alone() -> None:
    pilot = CountingPilot()
    pilot.plan("warm", ["taken text"], rid="taken")
    window = PlanningWindow(pilot, window_ms=200, adaptive=False)
    requests = [
        ("q0", [_own(0), *SHARED], {}),
        ("q1", [_own(1), *SHARED], {"rid": "taken"}),  # already indexed
        ("q2", [_own(2), *SHARED], {}),
    ]
    results = _in_threads(window, requests)
    assert isinstance(results[1], RidConflictError)
    assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)
    assert window.stats()["batch_failures"] == 1
    with pytest.raises(TypeError, match=r"blocks\[0\] must be a str"):
        window.plan("q", [3])  # refused before it joins a window


def test_plans_are_released_in_schedule_order() -> None:
    class Recording(ContextPilot):
        def plan_batch(self, requests):  # type: ignore[no-untyped-def]
            batch = super().plan_batch(requests)
            self.schedule = [batch.plans[i].rid for i in batch.schedule]
            return batch

    pilot = Recording()
    window = PlanningWindow(pilot, window_ms=200, adaptive=False)
    groups = ["first group " * 30, "second group " * 30]
    requests = [(f"q{i}", [groups[i % 2], _own(i)], {"rid": f"r{i}"}) for i in range(6)]
    released: list[str] = []
    deliver = _Member.deliver

    def recorded(member, plan, error):  # type: ignore[no-untyped-def]
        released.append(plan.rid)
        deliver(member, plan, error)

    with mock.patch.object(_Member, "deliver", recorded):
        _in_threads(window, requests)
    assert released == pilot.schedule
    assert {r[1:] for r in released[:3]} in ({"0", "2", "4"}, {"1", "3", "5"})  # grouped


def test_a_member_never_waits_for_good_when_the_leader_fails() -> None:
    class Interrupted(BaseException):
        """Not an Exception: the leader does not plan again one by one, it stops."""

    class Broken(ContextPilot):
        def plan_batch(self, requests):  # type: ignore[no-untyped-def]
            raise Interrupted("stopped while planning")

    window = PlanningWindow(Broken(), window_ms=100, adaptive=False)
    results: list = []

    def run(i: int) -> None:
        try:
            results.append(window.plan(f"q{i}", [_own(i)]))
        except Interrupted as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads)
    assert len(results) == 3 and all(isinstance(r, Interrupted) for r in results)


def test_zero_window_plans_at_once_and_adaptive_closes_early_without_sharing() -> None:
    pilot = CountingPilot()
    immediate = PlanningWindow(pilot, window_ms=0)
    started = time.monotonic()
    immediate.plan("q", [_own(1)])
    assert time.monotonic() - started < 0.1 and pilot.batches == [1]
    adaptive = PlanningWindow(CountingPilot(), window_ms=400, adaptive=True)
    started = time.monotonic()
    adaptive.plan("q", [_own(2)])  # alone, nothing shared: closes at half the window
    elapsed = time.monotonic() - started
    assert 0.15 < elapsed < 0.35 and adaptive.stats()["early_closes"] == 1


def test_the_policy_replays_arrivals_in_virtual_time() -> None:
    policy = WindowPolicy(window_s=0.010, max_batch=3, adaptive=True)
    shared = PlanRequest("q", [SHARED[0]])
    lone = [PlanRequest("q", [_own(i)]) for i in range(4)]
    arrivals = [
        (0.000, shared),
        (0.002, PlanRequest("q", [SHARED[0], _own(0)])),  # shares: the window runs 10 ms
        (0.008, lone[0]),
        (0.009, lone[1]),  # the window is full (3): closes now; this one opens the next
        (0.020, lone[2]),  # the lone window closed at half its length (5 ms after 0.009)
        (0.030, PlanRequest("q", [_own(9)], scope=Scope("c"))),
        (0.031, PlanRequest("q", [_own(8)], scope=Scope("c"))),  # same conversation
    ]
    windows = policy.group(arrivals)
    assert [indices for _, indices in windows] == [[0, 1, 2], [3], [4], [5], [6]]
    assert windows[0][0] == pytest.approx(0.008)
    assert windows[1][0] == pytest.approx(0.014)
    assert windows[3][0] == pytest.approx(0.031)
    with pytest.raises(ValueError, match="window_ms must be >= 0"):
        WindowPolicy(window_s=-1)
    with pytest.raises(ValueError, match="max_batch"):
        PlanningWindow(ContextPilot(), max_batch=0)
