"""The client against a real server: the same plans as in process, the same errors, auth, the
async twin, and the local fallback when the service is down."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from service_testing import blocks_of, free_port

from contextpilot_integrations.core.conversation import TurnVisibility
from contextpilot_integrations.core.pilot import ContextPilot, Plan, PlannedBlock
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.service.client import (
    AsyncContextPilotClient,
    ContextPilotClient,
    ServiceUnavailableError,
)
from contextpilot_integrations.service.schemas import LayoutModel, PlannedBlockModel, PlanResponse


def _scenario(pilot):  # type: ignore[no-untyped-def]
    """A fixed sequence of calls; returns every plan made (works on either interface)."""
    plans = []
    for number in range(4):
        plans.append(pilot.plan(f"question {number}?", blocks_of(number), rid=f"r{number}"))
    dup = blocks_of(9)
    plans.append(pilot.plan("with a duplicate", [dup[1], *dup, dup[0]], rid="dup"))
    conversation = blocks_of(20, own=3)
    plans.append(
        pilot.plan("turn one", conversation[:4], rid="t1", conversation_id="c", tenant="a")
    )
    plans.append(
        pilot.plan(
            "turn two",
            conversation[2:],
            rid="t2",
            conversation_id="c",
            tenant="a",
            visibility=TurnVisibility.last(1),
        )
    )
    batch = pilot.plan_batch(
        [f"batch {i}" for i in range(5)],
        [blocks_of(30 + i % 2) for i in range(5)],
        rids=[f"b{i}" for i in range(5)],
    )
    # A batch of next turns, one per conversation, with turn numbers and visibilities.
    turns = pilot.plan_batch(
        ["turn three", "other conversation"],
        [conversation[1:], blocks_of(20)],
        rids=["t3", "d1"],
        conversation_ids=["c", "d"],
        tenants=["a", "a"],
        turns=[3, None],
        visibilities=[TurnVisibility.only([1]), None],
    )
    return plans, [batch, turns]


def test_client_plans_equal_in_process_plans(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    with ContextPilotClient(server.base_url) as client:
        remote, remote_batch = _scenario(client)
        stats = client.stats()
    local, local_batch = _scenario(ContextPilot())
    assert remote == local  # every field, the layout included
    assert remote_batch == local_batch
    assert remote[6].replaced and remote[6].hints  # the conversation turn was de-duplicated
    assert remote_batch[1].plans[0].turn == 3 and remote_batch[1].plans[0].replaced
    assert any(p.annotation_labels for p in remote)
    assert [p.context_tail for p in remote] == [p.context_tail for p in local]
    assert remote[4].duplicates
    assert stats["requests"] == len(remote) + 5 + 2
    assert stats["service_reachable"] is True
    assert remote[0].messages[0]["content"] == local[0].layout.system_prompt


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda c: c.plan(3, ["a"]), TypeError, "query must be a str"),
        (lambda c: c.plan("q", "not a list"), TypeError, "blocks must be a sequence"),
        (lambda c: c.plan("q", ["ok", None]), TypeError, "blocks[1]"),
        (lambda c: c.plan("q", ["ok", "  \n"]), ValueError, "blocks[1]"),
        (lambda c: c.plan("q", ["ok"], rid=""), ValueError, "rid"),
        (lambda c: c.plan("q", ["ok"], turn=-1), ValueError, "turn"),
        (lambda c: c.plan("q", ["ok"], conversation_id=""), ValueError, "conversation_id"),
        (lambda c: c.plan_batch(["a"], [["x"], ["y"]]), ValueError, "queries has 1 entries"),
        (lambda c: c.plan_batch(["a", "b"], [["x"], ["y"]], rids=["s", "s"]), ValueError, "unique"),
        (
            lambda c: c.plan_batch(["a", "b"], [["x"], ["y"]], conversation_ids=["k", "k"]),
            ValueError,
            "appears twice",
        ),
        (lambda c: c.record_usage("r", 10, 11), ValueError, "cached_tokens"),
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
        with pytest.raises(ValueError, match="already indexed"):
            client.plan("q", blocks_of(2), rid="same")
        with pytest.raises(ValueError, match="already indexed"):
            client.plan_batch(["q"], [blocks_of(3)], rids=["same"])
        assert client.stats()["requests"] == before + 1
        assert client.evict(first.rid) is True
        assert client.evict(first.rid) is False


def test_forget_conversation_and_usage(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()
    texts = blocks_of(5)
    with ContextPilotClient(server.base_url) as client:
        client.plan("one", texts, conversation_id="conv", tenant="t")
        again = client.plan("two", texts, conversation_id="conv", tenant="t")
        assert len(again.replaced) == len(texts)  # all shown in turn 1
        assert client.forget_conversation("conv", tenant="t") is True
        assert client.forget_conversation("conv", tenant="t") is False
        fresh = client.plan("three", texts, conversation_id="conv", tenant="t")
        assert fresh.replaced == {} and fresh.turn == 1
        assert client.record_usage(fresh.rid, 1000, 640) is True
        assert client.record_usage("unknown-rid", 100, 0) is False
        usage = client.stats()["usage"]
    assert usage == {
        "reports": 2,
        "prompt_tokens": 1100,
        "cached_tokens": 640,
        "hit_ratio": 640 / 1100,
    }


def test_api_key_is_required_when_set(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(env={"CONTEXTPILOT_API_KEY": "s3cret"})
    for key in (None, "wrong"):
        with ContextPilotClient(server.base_url, api_key=key) as client:
            with pytest.raises(PermissionError, match="API key"):
                client.plan("q", ["a block"])
            assert client.health()["status"] == "ok"  # /health is open
    with ContextPilotClient(server.base_url, api_key="s3cret") as client:
        assert client.plan("q", ["a block"]).order == [0]
        assert client.stats()["requests"] == 1


def test_async_client_matches_the_blocking_one(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory()

    async def run():  # type: ignore[no-untyped-def]
        async with AsyncContextPilotClient(server.base_url) as client:
            plans = await asyncio.gather(
                *(client.plan(f"q{i}", blocks_of(i), rid=f"a{i}") for i in range(10))
            )
            batch = await client.plan_batch(["x", "y"], [blocks_of(1), blocks_of(2)])
            with pytest.raises(TypeError, match="query must be a str"):
                await client.plan(None, ["a"])  # type: ignore[arg-type]
            evicted = await client.evict("a3")
            forgotten = await client.forget_conversation("none")
            stats = await client.stats()
            layout = await client.layout()
            return plans, batch, evicted, forgotten, stats, layout

    plans, batch, evicted, forgotten, stats, layout = asyncio.run(run())
    assert sorted(p.rid for p in plans) == sorted(f"a{i}" for i in range(10))
    assert all(sorted(p.order) == list(range(6)) for p in plans)
    assert sorted(batch.schedule) == [0, 1]
    assert evicted is True and forgotten is False
    assert stats["requests"] == 11  # 10 + 2 - 1
    assert layout == ContextPilot().layout


def test_service_down_plans_locally_warns_once_and_recovers(server_factory, caplog) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    client = ContextPilotClient(f"http://127.0.0.1:{port}", retry_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="contextpilot_integrations.service.client"):
        plans = [client.plan(f"q{i}", blocks_of(i)) for i in range(3)]
        batch = client.plan_batch(["x", "y"], [blocks_of(1), blocks_of(2)])
    assert all(sorted(p.order) == list(range(6)) for p in plans)  # lossless plans all the same
    assert len(batch.plans) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "planning locally" in warnings[0].getMessage()
    stats = client.stats()
    assert stats["service_reachable"] is False
    assert stats["client"]["fallback_plans"] == 4 and stats["client"]["service_failures"] >= 4
    assert client.evict(plans[0].rid) is True  # the local fallback index had it

    server = server_factory(port=port)  # the service comes (back) up on that port
    plan = client.plan("after", blocks_of(1), rid="served")
    assert client.stats()["service_reachable"] is True
    assert httpx_get_stats(server.base_url)["requests"] == 1 and plan.rid == "served"
    client.close()


def test_service_down_without_fallback_raises() -> None:
    client = ContextPilotClient(f"http://127.0.0.1:{free_port()}", fallback=False)
    with pytest.raises(ServiceUnavailableError):
        client.plan("q", ["a block"])
    with pytest.raises(ServiceUnavailableError):
        client.health()


def httpx_get_stats(base_url: str) -> dict:  # type: ignore[type-arg]
    import httpx

    return httpx.get(f"{base_url}/v1/stats").json()


def test_the_wire_format_carries_every_field_of_the_core_plan() -> None:
    """Fails when the core's Plan, PlannedBlock or PromptLayout gains a field the service does
    not send (the client would rebuild it with its default)."""
    plan_fields = {f.name for f in dataclasses.fields(Plan)} - {"layout"}
    assert set(PlanResponse.model_fields) == plan_fields
    assert set(PlannedBlockModel.model_fields) == {f.name for f in dataclasses.fields(PlannedBlock)}
    assert set(LayoutModel.model_fields) == {f.name for f in dataclasses.fields(PromptLayout)}
