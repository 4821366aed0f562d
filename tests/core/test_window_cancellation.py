"""One caller's cancellation or timeout never fails, delays or changes another caller of the
same planning window: a cancelled first caller (it opened the window) leaves the window to the
others, a timeout while the window's batch is planned reaches its own caller only, and the plan
a cancelled caller never received is undone. Threads and coroutines (on one or several event
loops) mixed; a random stress run through ``benchmarks/micro/bench_window_cancellation.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from contextpilot_integrations import ContextPilot, Plan, PlanningWindow, Scope

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "micro" / "bench_window_cancellation.py"
WINDOW_THREADS = "contextpilot-planning-window"  # the prefix of the window's thread names


def doc(i: int) -> str:
    return f"Passage {i}: " + " ".join(f"word{i}_{j}" for j in range(60))


SHARED = "A shared passage: " + " ".join(f"common{j}" for j in range(60))


class SlowBatches(ContextPilot):
    """``plan_batch`` takes ``delay_s`` longer, after its turns are recorded: a timeout of
    its caller then fires while the batch is being planned."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.batches: list[int] = []

    def plan_batch(self, requests):  # type: ignore[no-untyped-def]
        batch = super().plan_batch(requests)
        self.batches.append(len(requests))
        time.sleep(self.delay_s)
        return batch


def settled(timeout_s: float = 5.0) -> None:
    """Wait until the windows' own threads (planning, undoing) have ended."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name.startswith(WINDOW_THREADS):
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), f"{thread.name} still runs"


def recorded(pilot: ContextPilot, conversation: str, text: str) -> bool:
    """Whether ``conversation`` has a turn that showed ``text`` (its next turn hints at it)."""
    probe = pilot.plan("again", [text], scope=Scope(conversation))
    return probe.placements[0].status.value == "replaced"


def test_a_cancelled_first_caller_leaves_its_window_to_the_others() -> None:
    pilot = ContextPilot()
    window = PlanningWindow(pilot, window_ms=200, max_batch=8, adaptive=False)
    thread_plans: list[Plan] = []

    async def main() -> tuple[list[object], list[object]]:
        leader = asyncio.ensure_future(window.aplan("q", [doc(0)], scope=Scope("leader")))
        await asyncio.sleep(0.02)  # the leader's window is open
        members = [
            asyncio.ensure_future(window.aplan(f"m{i}", [doc(i)], scope=Scope(f"m{i}")))
            for i in (1, 2)
        ]
        thread = threading.Thread(
            target=lambda: thread_plans.append(
                window.plan("t", [doc(3)], scope=Scope("thread member"))
            )
        )
        thread.start()
        await asyncio.sleep(0.02)
        leader.cancel()
        await asyncio.sleep(0.02)
        later = [
            asyncio.ensure_future(window.aplan(f"l{i}", [doc(10 + i)], scope=Scope(f"l{i}")))
            for i in range(10)
        ]
        started = time.monotonic()
        done, pending = await asyncio.wait([*members, *later], timeout=3.0)
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} callers still wait after 3 s"
        assert time.monotonic() - started < 1.5  # one window length or two, not more
        await asyncio.to_thread(thread.join, 3.0)
        with pytest.raises(asyncio.CancelledError):
            await leader
        return [t.result() for t in members], [t.result() for t in later]

    members, later = asyncio.run(main())
    assert len(members) == 2 and len(later) == 10 and len(thread_plans) == 1
    assert all(isinstance(plan, Plan) for plan in [*members, *later])
    settled()
    assert window._open is None  # no window is left open for later callers to wait in
    assert not recorded(pilot, "leader", doc(0))  # withdrawn before planning: nothing planned
    assert recorded(pilot, "m1", doc(1)) and recorded(pilot, "thread member", doc(3))


@pytest.mark.parametrize("members_on", ["one loop", "a thread and another loop"])
def test_a_timeout_while_the_batch_is_planned_reaches_its_own_caller_only(
    members_on: str,
) -> None:
    pilot = SlowBatches(delay_s=0.3)
    window = PlanningWindow(pilot, window_ms=50, adaptive=False)
    outside: list[object] = []

    def in_a_thread() -> None:
        try:
            outside.append(window.plan("t", [SHARED, doc(3)], scope=Scope("thread")))
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outside.append(exc)

    async def on_another_loop() -> Plan:
        return await window.aplan("o", [SHARED, doc(4)], scope=Scope("other loop"))

    async def main() -> list[object]:
        # The first caller opens the window and times out while its batch is planned.
        leader = asyncio.ensure_future(
            asyncio.wait_for(window.aplan("q", [SHARED, doc(0)], scope=Scope("leader")), 0.15)
        )
        await asyncio.sleep(0.01)
        members = [
            asyncio.ensure_future(window.aplan(f"m{i}", [SHARED, doc(i)], scope=Scope(f"m{i}")))
            for i in (1, 2)
        ]
        threads = []
        if members_on != "one loop":
            threads = [
                threading.Thread(target=in_a_thread),
                threading.Thread(target=lambda: outside.append(asyncio.run(on_another_loop()))),
            ]
            for thread in threads:
                thread.start()
        with pytest.raises(asyncio.TimeoutError):
            await leader
        results = await asyncio.gather(*members, return_exceptions=True)
        for thread in threads:
            await asyncio.to_thread(thread.join, 5.0)
        return [*results, *outside]

    results = asyncio.run(main())
    assert all(isinstance(result, Plan) for result in results), results
    assert len(results) == (2 if members_on == "one loop" else 4)
    assert pilot.batches == [len(results) + 1]  # the leader's request was in the batch
    settled()
    assert not recorded(pilot, "leader", doc(0))  # planned, never received: undone
    assert recorded(pilot, "m1", doc(1)) and recorded(pilot, "m2", doc(2))


def test_a_member_whose_event_loop_has_closed_is_undone_and_the_others_go_on() -> None:
    pilot = SlowBatches(delay_s=0.2)
    window = PlanningWindow(pilot, window_ms=50, adaptive=False)
    results: list[object] = []

    async def short_lived() -> None:
        # Times out while the batch is planned; asyncio.run then closes its loop.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                window.aplan("gone", [SHARED, doc(9)], scope=Scope("gone")), 0.08
            )

    def planned_in_a_thread(i: int) -> None:
        results.append(window.plan(f"t{i}", [SHARED, doc(i)], scope=Scope(f"t{i}")))

    threads = [threading.Thread(target=planned_in_a_thread, args=(i,)) for i in (1, 2)]
    gone = threading.Thread(target=lambda: asyncio.run(short_lived()))
    for thread in [gone, *threads]:
        thread.start()
    for thread in [gone, *threads]:
        thread.join(5.0)
    assert len(results) == 2 and all(isinstance(result, Plan) for result in results)
    assert pilot.batches == [3]
    settled()
    assert not recorded(pilot, "gone", doc(9))
    assert recorded(pilot, "t1", doc(1))


def test_cancelling_every_caller_of_an_open_window_plans_nothing() -> None:
    pilot = SlowBatches(delay_s=0.0)
    window = PlanningWindow(pilot, window_ms=100, adaptive=False)

    async def main() -> None:
        tasks = [
            asyncio.ensure_future(window.aplan(f"q{i}", [doc(i)], scope=Scope(f"c{i}")))
            for i in range(3)
        ]
        await asyncio.sleep(0.02)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        after = await asyncio.wait_for(window.aplan("next", [doc(5)], scope=Scope("next")), 3)
        assert after.scope.turn == 1  # it did not wait in the abandoned window for ever

    asyncio.run(main())
    settled()
    assert pilot.batches == []  # the emptied window closed; the next request went alone
    assert window.stats()["windows"] == 1 and window.stats()["requests"] == 1
    assert not any(recorded(pilot, f"c{i}", doc(i)) for i in range(3))


def test_random_cancellations_and_timeouts_hang_and_fail_no_other_caller() -> None:
    completed = subprocess.run(
        [sys.executable, str(BENCHMARK), "--callers", "600", "--seed", "7", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(completed.stdout)
    print({key: figures[key] for key in ("callers", "cancelled", "timed_out", "seconds")})
    assert figures["callers"] == 600
    assert figures["cancelled"] > 0 and figures["timed_out"] > 0 and figures["batches"] > 0
    assert figures["cancelled_in_planning"] > 0  # some gave up while their batch was planned
    assert figures["hung"] == 0, figures
    assert figures["spurious_cancellations"] == 0, figures
    assert figures["other_errors"] == 0, figures
    assert figures["windows_left_open"] == 0, figures
    assert figures["phantom_turns"] == 0 and figures["lost_turns"] == 0, figures
