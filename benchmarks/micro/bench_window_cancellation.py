"""Callers of one planning window cancelled and timed out at random: hung callers, and
``CancelledError`` reaching callers nobody cancelled (target: 0 and 0).

Run: ``.venv/bin/python benchmarks/micro/bench_window_cancellation.py`` (default 10,000 callers;
``--callers 600`` for a quick run, ``--json`` for machine-readable output;
``tests/core/test_window_cancellation.py`` runs a small one in CI). Exits 1 when a target is
missed.

Set-up: one :class:`~contextpilot_integrations.core.window.planning_window.PlanningWindow`
(``--window-ms``, ``max_batch`` 8, not adaptive, so each window stays open its full length) in
front of a ``ContextPilot`` whose ``plan`` and ``plan_batch`` take up to 4 ms longer, before or
after the turns are recorded. Callers arrive in bursts (1 to 12, a fraction of a window apart;
the next burst may start before the last window closed or after), each a conversation of its
own with one passage of its own and one of four shared passages. A caller is

* a coroutine on the main event loop,
* a coroutine on one of two event loops run by other threads,
* a coroutine in a thread of its own (``asyncio.run``: its loop closes as soon as it returns),
* or a thread calling ``plan`` (a thread's call cannot be cancelled: always left alone).

A coroutine is left alone, cancelled after a random delay (``task.cancel()``), or given a
random ``asyncio.wait_for`` timeout; the delays span the window's wait and its planning, and
the first caller of a burst (which opens a window when none is open) is cancelled more often.

Figures: ``hung`` (callers without an outcome ``--hang-s`` seconds after the last arrival),
``spurious_cancellations`` (a ``CancelledError`` or timeout reaching a caller left alone, or
cancelled only after it had its outcome), ``other_errors``, ``windows_left_open`` (an open
window or a window thread still running once every caller has its outcome), and, from each
conversation's next turn: ``phantom_turns`` (a turn recorded for a plan its caller never
received: the next turn hints at it) and ``lost_turns`` (a plan received but not recorded).
``cancelled_in_planning`` counts the cancelled or timed-out callers whose request was in a
batch the pilot planned (their plan was made and had to be undone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from contextpilot_integrations import ContextPilot, PlanningWindow, Scope
from contextpilot_integrations.core.conversations.conversation import ConversationStore
from contextpilot_integrations.core.conversations.dedup import Deduplicator
from contextpilot_integrations.core.window.planning_window import (
    UNDO_THREAD_NAME,
    WINDOW_THREAD_NAME,
)

SHARED = [f"Shared passage {k}: " + " ".join(f"common{k}_{j}" for j in range(60)) for k in range(4)]
KINDS = ("main loop", "other loop", "own loop", "thread")
KIND_WEIGHTS = (0.45, 0.2, 0.1, 0.25)
MAX_PLANNING_DELAY_S = 0.004


def own_passage(n: int) -> str:
    return f"Passage {n}: " + " ".join(f"word{n}_{j}" for j in range(60))


class SlowPilot(ContextPilot):
    """Plans up to ``MAX_PLANNING_DELAY_S`` slower, before or after recording the turns, and
    remembers the rids it planned in batches."""

    def __init__(self, callers: int) -> None:
        store = ConversationStore(max_conversations=callers + 16, ttl_seconds=None)
        super().__init__(deduplicator=Deduplicator(store))
        self.batched: set[str] = set()
        self.batches = 0
        self._lock = threading.Lock()

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        return self._slowly(lambda: super(SlowPilot, self).plan(*args, **kwargs))

    def plan_batch(self, requests: Any) -> Any:
        batch = self._slowly(lambda: super(SlowPilot, self).plan_batch(requests))
        with self._lock:
            self.batches += 1
            self.batched.update(plan.rid for plan in batch.plans)
        return batch

    @staticmethod
    def _slowly(call: Any) -> Any:
        before = random.random() < 0.5
        delay = random.uniform(0.0, MAX_PLANNING_DELAY_S)
        if before:
            time.sleep(delay)
        result = call()
        if not before:
            time.sleep(delay)
        return result


@dataclass
class Caller:
    n: int
    kind: str
    mode: str  # "alone", "cancel" or "timeout"
    delay_s: float
    outcome: str | None = None  # "plan", "cancelled", "timed out", "error: <type>"
    cancel_sent: bool = False

    @property
    def conversation(self) -> str:
        return f"conversation {self.n}"

    @property
    def rid(self) -> str:
        return f"rid-{self.n}"


class Stress:
    """One run: the window, the callers and their outcomes."""

    def __init__(self, callers: int, window_ms: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pilot = SlowPilot(callers)
        self.window = PlanningWindow(self.pilot, window_ms=window_ms, max_batch=8, adaptive=False)
        self.window_s = window_ms / 1000.0
        self.callers: list[Caller] = []
        self.count = callers
        self._lock = threading.Lock()
        self.loops = [asyncio.new_event_loop() for _ in range(2)]
        for loop in self.loops:
            threading.Thread(target=loop.run_forever, daemon=True).start()

    def blocks(self, caller: Caller) -> list[str]:
        return [SHARED[caller.n % len(SHARED)], own_passage(caller.n)]

    def finish(self, caller: Caller, outcome: str) -> None:
        with self._lock:
            caller.outcome = outcome

    async def as_coroutine(self, caller: Caller) -> None:
        """Plan ``caller``'s request from a coroutine, cancelling or timing it out as drawn."""
        call = self.window.aplan(
            "question", self.blocks(caller), rid=caller.rid, scope=Scope(caller.conversation)
        )
        try:
            if caller.mode == "timeout":
                await asyncio.wait_for(call, caller.delay_s)
            elif caller.mode == "cancel":
                task = asyncio.ensure_future(call)

                def cancel() -> None:
                    if not task.done():
                        caller.cancel_sent = True
                        task.cancel()

                asyncio.get_running_loop().call_later(caller.delay_s, cancel)
                await task
            else:
                await call
        except asyncio.CancelledError:
            self.finish(caller, "cancelled")
        except asyncio.TimeoutError:
            self.finish(caller, "timed out")
        except Exception as exc:  # noqa: BLE001 - counted
            self.finish(caller, f"error: {type(exc).__name__}")
        else:
            self.finish(caller, "plan")

    def in_a_thread(self, caller: Caller) -> None:
        try:
            self.window.plan(
                "question", self.blocks(caller), rid=caller.rid, scope=Scope(caller.conversation)
            )
        except BaseException as exc:  # noqa: BLE001 - counted
            self.finish(caller, f"error: {type(exc).__name__}")
        else:
            self.finish(caller, "plan")

    def start(self, caller: Caller) -> None:
        if caller.kind == "main loop":
            asyncio.ensure_future(self.as_coroutine(caller))
        elif caller.kind == "other loop":
            loop = self.loops[caller.n % len(self.loops)]
            asyncio.run_coroutine_threadsafe(self.as_coroutine(caller), loop)
        elif caller.kind == "own loop":
            threading.Thread(
                target=lambda: asyncio.run(self.as_coroutine(caller)), daemon=True
            ).start()
        else:
            threading.Thread(target=self.in_a_thread, args=(caller,), daemon=True).start()

    def draw(self, n: int, opens_burst: bool) -> Caller:
        kind = self.rng.choices(KINDS, KIND_WEIGHTS)[0]
        mode = "alone"
        if kind != "thread" and self.rng.random() < (0.6 if opens_burst else 0.3):
            mode = self.rng.choice(("cancel", "timeout"))
        delay = self.rng.uniform(0.0, self.window_s + 3 * MAX_PLANNING_DELAY_S)
        return Caller(n, kind, mode, delay)

    async def arrive(self) -> None:
        """Start every caller, in bursts."""
        while len(self.callers) < self.count:
            size = min(self.rng.randint(1, 12), self.count - len(self.callers))
            for position in range(size):
                caller = self.draw(len(self.callers), position == 0)
                self.callers.append(caller)
                self.start(caller)
                await asyncio.sleep(self.rng.uniform(0.0, self.window_s / 8))
            await asyncio.sleep(self.rng.uniform(0.3, 1.5) * self.window_s)

    async def wait_for_outcomes(self, hang_s: float) -> int:
        """Callers still without an outcome after ``hang_s`` seconds."""
        deadline = time.monotonic() + hang_s
        while time.monotonic() < deadline:
            with self._lock:
                waiting = sum(caller.outcome is None for caller in self.callers)
            if not waiting:
                return 0
            await asyncio.sleep(0.01)
        return waiting

    def windows_left_open(self, timeout_s: float) -> int:
        """Open windows and window threads still running after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        for thread in threading.enumerate():
            if thread.name in (WINDOW_THREAD_NAME, UNDO_THREAD_NAME):
                thread.join(max(0.0, deadline - time.monotonic()))
        running = sum(
            thread.is_alive() and thread.name == WINDOW_THREAD_NAME
            for thread in threading.enumerate()
        )
        return running + (self.window._open is not None)

    def recorded(self, caller: Caller) -> bool:
        """Whether the conversation's next turn hints at the caller's own passage."""
        probe = self.pilot.plan("again", [own_passage(caller.n)], scope=Scope(caller.conversation))
        return probe.placements[0].status.value == "replaced"


async def run(callers: int, window_ms: float, seed: int, hang_s: float) -> dict[str, Any]:
    stress = Stress(callers, window_ms, seed)
    started = time.monotonic()
    await stress.arrive()
    hung = await stress.wait_for_outcomes(hang_s)
    seconds = time.monotonic() - started
    left_open = await asyncio.to_thread(stress.windows_left_open, 5.0)
    outcomes: Counter[str] = Counter()
    figures: Counter[str] = Counter()
    for caller in stress.callers:
        outcome = caller.outcome or "hung"
        outcomes[outcome] += 1
        gave_up = outcome in ("cancelled", "timed out")
        if gave_up and (
            caller.mode == "alone" or (caller.mode == "cancel" and not caller.cancel_sent)
        ):
            figures["spurious_cancellations"] += 1
        if outcome == "cancelled" and caller.mode == "timeout":
            figures["spurious_cancellations"] += 1  # wait_for turns its own into a timeout
        if outcome.startswith("error"):
            figures["other_errors"] += 1
        if gave_up and caller.rid in stress.pilot.batched:
            figures["cancelled_in_planning"] += 1
        if outcome == "hung":
            continue
        recorded = stress.recorded(caller)
        figures["phantom_turns"] += recorded and outcome != "plan"
        figures["lost_turns"] += outcome == "plan" and not recorded
    for loop in stress.loops:
        loop.call_soon_threadsafe(loop.stop)
    kinds = Counter(caller.kind for caller in stress.callers)
    return {
        "callers": len(stress.callers),
        "seconds": round(seconds, 2),
        "window_ms": window_ms,
        "by_kind": dict(kinds),
        "outcomes": dict(outcomes),
        "plans": outcomes["plan"],
        "cancelled": outcomes["cancelled"],
        "timed_out": outcomes["timed out"],
        "batches": stress.pilot.batches,
        "window_stats": stress.window.stats(),
        "cancelled_in_planning": figures["cancelled_in_planning"],
        "hung": hung,
        "spurious_cancellations": figures["spurious_cancellations"],
        "other_errors": figures["other_errors"],
        "windows_left_open": left_open,
        "phantom_turns": figures["phantom_turns"],
        "lost_turns": figures["lost_turns"],
    }


TARGETS = (
    "hung",
    "spurious_cancellations",
    "other_errors",
    "windows_left_open",
    "phantom_turns",
    "lost_turns",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=10_000)
    parser.add_argument("--window-ms", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hang-s", type=float, default=10.0, help="a caller without an outcome after this is hung"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = asyncio.run(run(args.callers, args.window_ms, args.seed, args.hang_s))
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:>24}: {value}")
    return 0 if all(figures[key] == 0 for key in TARGETS) else 1


if __name__ == "__main__":
    sys.exit(main())
