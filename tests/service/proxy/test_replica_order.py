"""The proxy's door to each replica: calls in ticket order, each once the one before started its
answer, at most ``max_in_flight`` out, and no call waiting for good (docs/DESIGN.md, "The
proxy")."""

from __future__ import annotations

import asyncio

import pytest

from contextpilot_integrations.service.proxy.replica_order import ReplicaOrder


async def _gone(task: asyncio.Task[None]) -> bool:
    await asyncio.sleep(0.01)
    return task.done()


def test_calls_go_in_ticket_order_each_after_the_previous_started() -> None:
    async def scenario() -> None:
        order = ReplicaOrder(ordered=True, max_in_flight=8)
        for rid in ("r1", "r2", "r3"):
            order.issue(rid, "a")
        order.issue("s1", "b")
        third = asyncio.create_task(order.enter("r3", "a"))
        second = asyncio.create_task(order.enter("r2", "a"))
        assert not await _gone(third) and not await _gone(second)
        await asyncio.wait_for(order.enter("s1", "b"), 1)  # another replica is not held
        await asyncio.wait_for(order.enter("r1", "a"), 1)
        assert not await _gone(second)
        order.started("r1")
        assert await _gone(second) and not await _gone(third)
        order.finish("r2")  # failed before its answer started: the next goes all the same
        assert await _gone(third)
        assert order.stats()["in_flight"] == {"a": 2, "b": 1}

    asyncio.run(scenario())


def test_at_most_max_in_flight_go_out_per_replica() -> None:
    async def scenario() -> None:
        order = ReplicaOrder(ordered=False, max_in_flight=2)
        await order.enter("r1", "a")
        await order.enter("r2", "a")
        third = asyncio.create_task(order.enter("r3", "a"))
        assert not await _gone(third)
        order.started("r1")  # started is not over: still in flight
        assert not await _gone(third)
        order.finish("r1")
        assert await _gone(third)

    asyncio.run(scenario())


def test_no_call_waits_for_good() -> None:
    async def scenario() -> None:
        now = [0.0]
        order = ReplicaOrder(ordered=True, stale_s=0.05, clock=lambda: now[0])
        order.issue("never-comes", "a")
        order.issue("r2", "a")
        waiting = asyncio.create_task(order.enter("r2", "a"))
        assert not await _gone(waiting)
        now[0] = 1.0  # the ticket's call never came: dropped at the next look
        await asyncio.wait_for(waiting, 1)
        assert order.stats()["stale"] == 1
        # A call cancelled while it waits leaves its place to the next.
        order.issue("r3", "a")
        order.issue("r4", "a")
        cancelled = asyncio.create_task(order.enter("r3", "a"))
        fourth = asyncio.create_task(order.enter("r4", "a"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        order.finish("r3")
        order.finish("r2")
        await asyncio.wait_for(fourth, 1)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"max_in_flight": 0}, "max_in_flight"), ({"stale_s": 0}, "stale_s")],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ReplicaOrder(**kwargs)  # type: ignore[arg-type]


def test_backlogged_only_while_every_replica_has_calls_waiting_at_its_door() -> None:
    async def scenario() -> None:
        now = [0.0]
        order = ReplicaOrder(ordered=False, max_in_flight=1, stale_s=10.0, clock=lambda: now[0])
        assert not order.backlogged(["a", "b"]) and not order.backlogged([])
        await order.enter("a1", "a")
        await order.enter("b1", "b")
        assert not order.backlogged(["a", "b"])  # out, nothing waiting
        second = asyncio.create_task(order.enter("a2", "a"))
        assert not await _gone(second)
        assert order.backlogged(["a"]) and not order.backlogged(["a", "b"])
        order.issue("b2", "b")  # planned, on its way to the door: it will wait too
        assert order.backlogged(["a", "b"])
        now[0] = 11.0  # a ticket whose call never came stops counting; a waiting call does not
        assert order.backlogged(["a"]) and not order.backlogged(["a", "b"])
        assert order.stats()["waiting"] == {"a": 1, "b": 0}
        order.finish("a1")
        assert await _gone(second) and not order.backlogged(["a"])

    asyncio.run(scenario())


def test_a_replica_whose_call_never_starts_holds_nobody_past_stuck_s() -> None:
    async def scenario() -> None:
        now = [0.0]
        order = ReplicaOrder(ordered=True, max_in_flight=1, stuck_s=30.0, clock=lambda: now[0])
        for rid in ("hung", "r2", "r3"):
            order.issue(rid, "a")
        await order.enter("hung", "a")  # out, and its engine never answers
        second = asyncio.create_task(order.enter("r2", "a"))
        third = asyncio.create_task(order.enter("r3", "a"))
        now[0] = 29.0
        assert not await _gone(second) and not await _gone(third)
        now[0] = 31.0  # the call out has not started in stuck_s: the others go, both at once
        order.issue("poke", "b")  # any event makes the waiters look again
        order.finish("poke")
        assert await _gone(second) and await _gone(third)
        assert order.stats()["past_stuck"] == 2 and order.stats()["in_flight"] == {"a": 3}
        order.started("hung")  # it answers after all: the door holds again
        order.issue("r4", "a")
        fourth = asyncio.create_task(order.enter("r4", "a"))
        assert not await _gone(fourth)  # behind r2 and r3, which have not started
        fourth.cancel()

    asyncio.run(scenario())
