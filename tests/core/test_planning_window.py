"""The planning window: concurrent requests planned jointly, released in schedule order."""

from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

import pytest

from contextpilot_integrations import ContextPilot, PlanRequest, RidConflictError, Scope
from contextpilot_integrations.core.planner_protocol import check_planner
from contextpilot_integrations.core.window.planning_window import PlanningWindow, _Member
from contextpilot_integrations.core.window.window_policy import WindowPolicy

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
    assert sum(pilot.batches) + pilot.singles == 3 and max(pilot.batches, default=1) <= 2
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


class _Recording(ContextPilot):
    """Records the schedule of the batches it plans (rids in schedule order)."""

    def plan_batch(self, requests):  # type: ignore[no-untyped-def]
        batch = super().plan_batch(requests)
        self.schedule = [batch.plans[i].rid for i in batch.schedule]
        return batch


def test_plans_are_released_in_schedule_order() -> None:
    pilot = _Recording()
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


def test_on_handed_sees_every_plan_in_schedule_order_before_any_caller_has_it() -> None:
    pilot = _Recording()
    handed: list[str] = []
    early: list[int] = []

    def on_handed(plan):  # type: ignore[no-untyped-def]
        handed.append(plan.rid)
        if plan.rid == "r0":
            raise RuntimeError("a hook that fails hands the plans out all the same")

    window = PlanningWindow(pilot, window_ms=200, adaptive=False, on_handed=on_handed)
    deliver = _Member.deliver

    def recorded(member, plan, error):  # type: ignore[no-untyped-def]
        early.append(len(handed))
        deliver(member, plan, error)

    groups = ["first group " * 30, "second group " * 30]
    requests = [(f"q{i}", [groups[i % 2], _own(i)], {"rid": f"r{i}"}) for i in range(6)]
    with mock.patch.object(_Member, "deliver", recorded):
        results = _in_threads(window, requests)
    assert handed == pilot.schedule and early == [6] * 6
    assert [plan.rid for plan in results] == [f"r{i}" for i in range(6)]


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


def test_zero_window_and_sparse_traffic_plan_at_once_alone_with_plan() -> None:
    pilot = CountingPilot()
    immediate = PlanningWindow(pilot, window_ms=0)
    started = time.monotonic()
    immediate.plan("q", [_own(1)])
    assert time.monotonic() - started < 0.1
    assert pilot.batches == [] and pilot.singles == 1  # a window of one is a plain plan
    sparse = PlanningWindow(CountingPilot(), window_ms=400, adaptive=True)
    started = time.monotonic()
    sparse.plan("q", [_own(2)])  # nobody else expected (no recent arrivals): no wait
    assert time.monotonic() - started < 0.1 and sparse.stats()["closed_at_once"] == 1


def test_adaptive_closes_at_half_length_when_nothing_is_shared() -> None:
    clock = {"now": 0.0}
    window = PlanningWindow(
        CountingPilot(), window_ms=400, adaptive=True, clock=lambda: clock["now"]
    )
    for i in range(4):  # a burst: 1 ms apart, so more requests are expected
        window._rate.arrive(i * 0.001)
    clock["now"] = 0.004
    opened = time.monotonic()
    thread = threading.Thread(target=window.plan, args=("q", [_own(3)]))
    thread.start()
    time.sleep(0.05)
    clock["now"] = 0.004 + 0.201  # past half the window: nothing shared, it closes
    window._open.wake()  # type: ignore[union-attr]
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - opened < 1.0
    assert window.stats()["closed_at_half"] == 1


def test_the_policy_replays_arrivals_in_virtual_time() -> None:
    policy = WindowPolicy(window_s=0.010, max_batch=3, adaptive=True)
    lone = [PlanRequest("q", [_own(i)]) for i in range(10)]
    shares = [PlanRequest("q", [SHARED[0], _own(20 + i)]) for i in range(3)]
    arrivals = [
        (0.000, lone[0]),  # cold start: nobody else expected, it goes at once
        (0.001, shares[0]),
        (0.002, shares[1]),  # shares a block: this window runs the full 10 ms...
        (0.003, lone[1]),  # ...but is full at 3: closes now
        (0.004, lone[2]),  # opens a window in which nothing is shared: half length
        (0.020, lone[3]),
        (0.021, PlanRequest("q", [_own(9)], scope=Scope("c"))),
        (0.022, PlanRequest("q", [_own(8)], scope=Scope("c"))),  # same conversation
        (5.000, lone[4]),  # after a long gap the rate predicts nobody: alone, at once
        (10.00, lone[5]),
    ]
    windows = policy.group(arrivals)
    assert [indices for _, indices in windows] == [[0], [1, 2, 3], [4], [5, 6], [7], [8], [9]]
    closes = [when for when, _ in windows]
    assert closes[0] == pytest.approx(0.0) and closes[1] == pytest.approx(0.003)
    assert closes[2] == pytest.approx(0.009)  # 0.004 + 5 ms
    assert closes[3] == pytest.approx(0.022)  # the second turn of "c" closes it
    assert closes[5] == pytest.approx(5.0) and closes[6] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="window_ms must be >= 0"):
        WindowPolicy(window_s=-1)
    with pytest.raises(ValueError, match="max_batch"):
        PlanningWindow(ContextPilot(), max_batch=0)


def test_a_window_is_held_while_busy_and_gathers_the_calls_that_come_meanwhile() -> None:
    pilot = CountingPilot()
    busy = threading.Event()
    busy.set()
    window = PlanningWindow(
        pilot, window_ms=20, adaptive=False, hold=busy.is_set, max_hold_ms=30_000
    )
    results: list = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(window.plan(f"q{i}", [_own(i), *SHARED]))
        )
        for i in range(4)
    ]
    threads[0].start()
    time.sleep(0.2)  # ten times the window's length: held, not planned
    for thread in threads[1:]:
        thread.start()
    time.sleep(0.1)
    assert results == [] and pilot.batches == [] and pilot.singles == 0
    busy.clear()
    for thread in threads:
        thread.join(5)
    assert len(results) == 4 and pilot.batches == [4]  # the late ones joined the held window
    stats = window.stats()
    assert stats["held"] == 1 and stats["held_ms"] >= 200


def test_a_held_window_closes_at_its_bound_and_at_max_batch() -> None:
    window = PlanningWindow(
        CountingPilot(), window_ms=20, adaptive=False, hold=lambda: True, max_hold_ms=150
    )
    started = time.monotonic()
    window.plan("q", [_own(1)])
    waited = time.monotonic() - started
    assert 0.15 <= waited < 2.0  # held its length and the bound, then planned
    full = CountingPilot()
    window = PlanningWindow(
        full, window_ms=20, max_batch=3, adaptive=False, hold=lambda: True, max_hold_ms=30_000
    )
    started = time.monotonic()
    plans = _in_threads(window, [(f"q{i}", [_own(i), *SHARED], {}) for i in range(3)])
    assert all(not isinstance(plan, Exception) for plan in plans) and full.batches == [3]
    assert time.monotonic() - started < 2.0  # a full window is never held


def test_a_failing_hold_is_logged_once_and_holds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> bool:
        raise RuntimeError("door gone")

    window = PlanningWindow(
        CountingPilot(), window_ms=10, adaptive=False, hold=broken, max_hold_ms=30_000
    )
    started = time.monotonic()
    for i in range(3):
        window.plan("q", [_own(i)])
    assert time.monotonic() - started < 2.0
    assert [r.message for r in caplog.records].count(
        "the planning window's hold failed: windows close on time"
    ) == 1
    assert window.stats()["held"] == 0


def test_hold_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"max_hold_ms must be a number of milliseconds .* -1"):
        PlanningWindow(CountingPilot(), hold=lambda: True, max_hold_ms=-1)
    with pytest.raises(TypeError, match="hold must be callable or None, got int"):
        PlanningWindow(CountingPilot(), hold=3, max_hold_ms=10)  # type: ignore[arg-type]
