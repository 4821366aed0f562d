"""The client against a real server: the same plans as in process, the same errors, auth, the
async twins (also across event loops), and the local fallback when the service is down."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import warnings
import weakref

import httpx
import pytest
from service_testing import blocks_of, free_port

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.client.errors import ServiceUnavailableError
from contextpilot_integrations.client.schemas import (
    BatchPlanResponse,
    DedupFiguresModel,
    LayoutModel,
    PlacementModel,
    PlanRequestModel,
    PlanResponse,
    ScopeModel,
)
from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import (
    BatchPlan,
    DedupFigures,
    Placement,
    PlacementStatus,
    Plan,
)
from contextpilot_integrations.core.planner_protocol import Planner
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest, RidConflictError, Scope

SCOPE_A = Scope(conversation_id="c", tenant="a")


def _requests() -> tuple[list[PlanRequest], list[list[PlanRequest]]]:
    """A fixed sequence of single requests and of batches (the scenario of both tests)."""
    dup = blocks_of(9)
    conversation = blocks_of(20, own=3)
    singles = [PlanRequest(f"question {n}?", blocks_of(n), f"r{n}") for n in range(4)]
    singles += [
        PlanRequest("with a duplicate and an empty text", [dup[1], *dup, dup[0], " "], "dup"),
        PlanRequest("turn one", conversation[:4], "t1", SCOPE_A),
        PlanRequest(
            "turn two",
            conversation[2:],
            "t2",
            Scope("c", "a", visibility=TurnVisibility.last(1)),
        ),
    ]
    batches = [
        [PlanRequest(f"batch {i}", blocks_of(30 + i % 2), f"b{i}") for i in range(5)],
        # A batch of next turns, one per conversation, with turn numbers and visibilities.
        [
            PlanRequest(
                "turn three", conversation[1:], "t3", Scope("c", "a", 3, TurnVisibility.only([1]))
            ),
            PlanRequest("other conversation", blocks_of(20), "d1", Scope("d", "a")),
        ],
    ]
    return singles, batches


def _scenario(pilot):  # type: ignore[no-untyped-def]
    """Plans every request through ``pilot`` (any Planner), blocking calls."""
    singles, batches = _requests()
    plans = [pilot.plan(r.query, r.blocks, rid=r.rid, scope=r.scope) for r in singles]
    return plans, [pilot.plan_batch(batch) for batch in batches]


async def _ascenario(pilot):  # type: ignore[no-untyped-def]
    """As :func:`_scenario`, awaiting the async twins."""
    singles, batches = _requests()
    plans = [await pilot.aplan(r.query, r.blocks, rid=r.rid, scope=r.scope) for r in singles]
    return plans, [await pilot.aplan_batch(batch) for batch in batches]


def _statuses(plan: Plan) -> list[str]:
    return [p.status.value for p in plan.placements]


def test_client_plans_equal_in_process_plans(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    with ContextPilotClient(server.base_url) as client:
        remote, remote_batch = _scenario(client)
        stats = client.stats()
    local, local_batch = _scenario(ContextPilot())
    assert remote == local  # every field, the layout included
    assert remote_batch == local_batch
    assert "replaced" in _statuses(remote[6]) and remote[6].hints  # de-duplicated turn
    third = remote_batch[1].plans[0]
    assert third.scope.turn == 3 and "replaced" in _statuses(third)
    assert any(p.annotation_labels for p in remote)
    assert [p.context_tail for p in remote] == [p.context_tail for p in local]
    assert [p.output_order() for p in remote] == [p.output_order() for p in local]
    assert _statuses(remote[4]).count("duplicate") == 2 and _statuses(remote[4])[-1] == "skipped"
    assert stats["requests"] == len(remote) + 5 + 2
    assert stats["service_reachable"] is True
    assert remote[0].messages[0]["content"] == local[0].layout.system_prompt


def test_async_twins_equal_the_blocking_calls_across_event_loops(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    client = ContextPilotClient(server.base_url, fallback=False)
    # Each asyncio.run is a new event loop; the client makes a transport per loop.
    remote, remote_batch = asyncio.run(_ascenario(client))
    stats = asyncio.run(client.astats())
    local, local_batch = _scenario(ContextPilot())
    assert remote == local and remote_batch == local_batch
    assert stats["requests"] == len(remote) + 5 + 2 and stats["client"]["service_failures"] == 0

    async def concurrently():  # type: ignore[no-untyped-def]
        plans = await asyncio.gather(
            *(client.aplan(f"q{i}", blocks_of(i), rid=f"a{i}") for i in range(10))
        )
        with pytest.raises(TypeError, match="query must be a str"):
            await client.aplan(None, ["a"])  # type: ignore[arg-type]
        with pytest.raises(RidConflictError, match="already indexed"):
            await client.aplan("q", ["x"], rid="a1")
        evicted = await client.aevict("a3")
        forgotten = await client.aforget_conversation("none")
        usage = await client.arecord_usage("a4", 100, 10)
        health = await client.ahealth()
        saved = await client.asave_snapshot()
        return plans, evicted, forgotten, usage, health, saved

    plans, evicted, forgotten, usage, health, saved = asyncio.run(concurrently())
    assert sorted(p.rid for p in plans) == sorted(f"a{i}" for i in range(10))
    assert all(sorted(p.order) == list(range(6)) for p in plans)
    assert evicted is True and forgotten is False and usage is True
    assert health["status"] == "ok" and saved is False  # the server has no snapshot path
    assert client.stats()["requests"] == stats["requests"] + 9  # blocking, after async

    # Each loop's connections are closed on that loop when it shuts down: the client keeps no
    # ended loop alive, and nothing is left to the garbage collector.
    async def loop_of_a_call() -> weakref.ref[asyncio.AbstractEventLoop]:
        await client.astats()
        return weakref.ref(asyncio.get_running_loop())

    gc.collect()  # earlier tests' garbage is not this check's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        loops = [asyncio.run(loop_of_a_call()) for _ in range(3)]
        gc.collect()
    assert [loop() for loop in loops] == [None, None, None]
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
    client.close()


@pytest.mark.asyncio
async def test_the_client_is_a_planner_whose_async_twins_are_awaited(shared_server) -> None:  # type: ignore[no-untyped-def]
    # An async client must not pass the sync protocol's check with a plan that returns a
    # coroutine nothing awaits: one class has both twins.
    async with ContextPilotClient(shared_server.base_url, fallback=False) as client:
        assert isinstance(client, Planner)
        for name in ("aplan", "aplan_batch", "aevict", "arecord_usage", "astats", "ahealth"):
            assert inspect.iscoroutinefunction(getattr(client, name)), name
        for name in ("plan", "plan_batch", "evict", "record_usage", "stats", "health"):
            assert not inspect.iscoroutinefunction(getattr(client, name)), name
        plan = await client.aplan("q", blocks_of(77))
        assert isinstance(plan, Plan) and plan.layout == client.layout
        batch = await client.aplan_batch([PlanRequest("x", blocks_of(78))])
        assert isinstance(batch, BatchPlan) and batch.schedule == (0,)


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda c: c.plan(3, ["a"]), TypeError, "query must be a str"),
        (lambda c: c.plan("q", "not a list"), TypeError, "blocks must be a sequence"),
        (lambda c: c.plan("q", ["ok", None]), TypeError, "blocks[1]"),
        (lambda c: c.plan("q", ["ok"], rid=""), ValueError, "rid"),
        (lambda c: c.plan("q", ["ok"], scope=Scope("c", turn=-1)), ValueError, "scope.turn"),
        (lambda c: c.plan("q", ["ok"], scope=Scope(turn=1)), ValueError, "needs a scope."),
        (lambda c: c.plan("q", ["ok"], scope=Scope("")), ValueError, "conversation_id"),
        (lambda c: c.plan("q", ["ok"], scope={"tenant": "t"}), TypeError, "scope must be a"),
        (lambda c: c.plan_batch([PlanRequest("a", ["x"]), ("b", ["y"])]), TypeError, "requests[1]"),
        (
            lambda c: c.plan_batch([PlanRequest("a", ["x"], "s"), PlanRequest("b", ["y"], "s")]),
            ValueError,
            "unique",
        ),
        (
            lambda c: c.plan_batch(
                [
                    PlanRequest("a", ["x"], scope=Scope("k")),
                    PlanRequest("b", ["y"], scope=Scope("k")),
                ]
            ),
            ValueError,
            "turns of the same conversation",
        ),
        (lambda c: c.record_usage("r", 10, 11), ValueError, "cached_tokens"),
        (lambda c: c.record_usage("r", -1, 0), ValueError, "prompt_tokens"),
    ],
)
def test_bad_input_raises_the_core_error_naming_the_field(
    shared_server,  # type: ignore[no-untyped-def]
    call,
    error,
    words,
) -> None:
    with ContextPilotClient(shared_server.base_url, fallback=False) as client:
        before = client.stats()
        with pytest.raises(error) as raised:
            call(client)
        assert words in str(raised.value)
        after = client.stats()
        assert after["inserts"] == before["inserts"]  # nothing was indexed
        assert after["conversations"] == before["conversations"]


def test_a_rid_planned_twice_is_refused_and_the_first_kept(shared_server) -> None:  # type: ignore[no-untyped-def]
    with ContextPilotClient(shared_server.base_url) as client:
        before = client.stats()["requests"]
        first = client.plan("q", blocks_of(1), rid="same")
        with pytest.raises(RidConflictError, match="already indexed"):
            client.plan("q", blocks_of(2), rid="same")
        with pytest.raises(RidConflictError, match="already indexed"):
            client.plan_batch([PlanRequest("q", blocks_of(3), "same")])
        assert client.stats()["requests"] == before + 1
        assert client.evict(first.rid) is True
        assert client.evict(first.rid) is False


def test_forget_conversation_and_usage(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    texts = blocks_of(5)
    scope = Scope("conv", "t")
    with ContextPilotClient(server.base_url) as client:
        client.plan("one", texts, scope=scope)
        again = client.plan("two", texts, scope=scope)
        assert _statuses(again) == ["replaced"] * len(texts)  # all shown in turn 1
        assert client.forget_conversation("conv", tenant="t") is True
        assert client.forget_conversation("conv", tenant="t") is False
        fresh = client.plan("three", texts, scope=scope)
        assert "replaced" not in _statuses(fresh)  # nothing points to the forgotten turns
        assert client.record_usage(fresh.rid, 1000, 640) is True
        assert client.record_usage("unknown-rid", 100, 0) is False
        usage = client.stats()["usage"]
    assert {
        key: usage[key] for key in ("reports", "prompt_tokens", "cached_tokens", "hit_ratio")
    } == {
        "reports": 2,
        "prompt_tokens": 1100,
        "cached_tokens": 640,
        "hit_ratio": 640 / 1100,
    }
    local = ContextPilot()  # the turn numbers after a forget are the core's
    for query in ("one", "two"):
        local.plan(query, texts, scope=scope)
    local.deduplicator.store.forget("t", "conv")
    assert local.plan("three", texts, scope=scope).scope == fresh.scope


def test_api_key_is_required_when_set(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(env={"CONTEXTPILOT_API_KEY": "s3cret"})
    for key in (None, "wrong"):
        with ContextPilotClient(server.base_url, api_key=key) as client:
            with pytest.raises(PermissionError, match="API key"):
                client.plan("q", ["a block"])
            with pytest.raises(PermissionError, match="API key"):
                asyncio.run(client.aplan("q", ["a block"]))
            assert client.health()["status"] == "ok"  # /health is open
    with ContextPilotClient(server.base_url, api_key="s3cret") as client:
        assert client.plan("q", ["a block"]).order == [0]
        assert client.stats()["requests"] == 1


def test_service_down_plans_locally_warns_once_and_recovers(server_factory, caplog) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    client = ContextPilotClient(f"http://127.0.0.1:{port}", retry_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="contextpilot_integrations.client.client"):
        plans = [client.plan(f"q{i}", blocks_of(i)) for i in range(3)]
        batch = client.plan_batch([PlanRequest("x", blocks_of(1)), PlanRequest("y", blocks_of(2))])
        plans.append(asyncio.run(client.aplan("async", blocks_of(4))))  # the local aplan
        async_batch = asyncio.run(client.aplan_batch([PlanRequest("z", blocks_of(5))]))
    assert all(sorted(p.order) == list(range(6)) for p in plans)  # lossless plans all the same
    assert len(batch.plans) == 2 and len(async_batch.plans) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "planning locally" in warnings[0].getMessage()
    stats = client.stats()
    assert stats["service_reachable"] is False and stats["requests"] == 7
    assert stats["client"]["fallback_plans"] == 6 and stats["client"]["service_failures"] >= 6
    assert client.evict(plans[0].rid) is True  # the local fallback index had it
    assert asyncio.run(client.aevict(plans[1].rid)) is True

    server = server_factory(port=port)  # the service comes (back) up on that port
    plan = client.plan("after", blocks_of(1), rid="served")
    assert client.stats()["service_reachable"] is True
    assert httpx.get(f"{server.base_url}/v1/stats").json()["requests"] == 1
    assert plan.rid == "served"
    client.close()


def test_a_service_error_is_a_fallback_too() -> None:
    def failing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"message": "overloaded", "error_type": "HTTPError"})

    client = ContextPilotClient(
        "http://service.invalid",
        transport=httpx.MockTransport(failing),
        async_transport_factory=lambda: httpx.MockTransport(failing),
        retry_interval_s=0.0,
    )
    assert client.plan("q", ["a block"]).order == [0]
    assert asyncio.run(client.aplan("q", ["a block", "b block"])).order == [0, 1]
    assert client.stats()["client"]["fallback_plans"] == 2
    strict = ContextPilotClient(
        "http://service.invalid", transport=httpx.MockTransport(failing), fallback=False
    )
    with pytest.raises(ServiceUnavailableError, match="overloaded") as raised:
        strict.plan("q", ["a block"])
    assert raised.value.status_code == 503


def test_service_down_without_fallback_raises() -> None:
    client = ContextPilotClient(f"http://127.0.0.1:{free_port()}", fallback=False)
    with pytest.raises(ServiceUnavailableError):
        client.plan("q", ["a block"])
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(client.aplan("q", ["a block"]))
    with pytest.raises(ServiceUnavailableError):
        client.plan_batch([PlanRequest("q", ["a block"])])
    with pytest.raises(ServiceUnavailableError):
        client.health()
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(client.ahealth())


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_wire_format_carries_every_field_of_the_core_types() -> None:
    """Fails when the core's request, plan or layout types gain a field the service does not
    send (the client would rebuild it with its default)."""
    assert set(PlanRequestModel.model_fields) == _field_names(PlanRequest)
    assert set(ScopeModel.model_fields) == _field_names(Scope)
    assert set(PlanResponse.model_fields) == _field_names(Plan) - {"layout"}
    assert set(PlacementModel.model_fields) == _field_names(Placement)
    assert set(DedupFiguresModel.model_fields) == _field_names(DedupFigures)
    assert set(BatchPlanResponse.model_fields) == _field_names(BatchPlan)
    assert set(LayoutModel.model_fields) == _field_names(PromptLayout)
    assert {s.value for s in PlacementStatus} == set(
        PlacementModel.model_fields["status"].annotation.__args__  # type: ignore[union-attr]
    )
