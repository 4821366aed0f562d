"""Cancelled client calls against a real server with a planning window: every hint of every
plan a client received points at a turn that client received (docs/DESIGN.md, "Sure hints";
"Callers independent").

A cancelled ``aplan`` may leave its request waiting in the server's window; the client then
forgets the conversation before its next call, and that forget must not be overtaken by the
cancelled request's turn being recorded after it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from support.asgi_server import serve_in_thread

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.core.plan import PlacementStatus
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import TenantKeys

KEYS = {"alice": "alice-key-123", "bob": "bob-key-456"}
POOL = [f"Pool document {i}. " + f"shared body text {i}. " * 15 for i in range(20)]
CONVERSATIONS = 5
TURNS = 8


async def _conversation(
    client: ContextPilotClient, tenant: str, conversation: str, problems: list[str]
) -> int:
    """One conversation's turns, about a third cancelled after 0-30 ms; returns the plans
    received. ``problems``: each hint at text no received plan of it showed."""
    rnd = random.Random(f"{tenant}/{conversation}")
    shown: list[str] = []
    received = 0
    for turn in range(TURNS):
        blocks = [*rnd.sample(POOL, 5), f"private {tenant} {conversation} " * 20]
        task = asyncio.ensure_future(client.aplan(f"q{turn}", blocks, scope=Scope(conversation)))
        if rnd.random() < 0.35:
            await asyncio.sleep(rnd.random() * 0.03)
            task.cancel()
        try:
            plan = await asyncio.wait_for(task, 60)
        except asyncio.CancelledError:
            continue
        received += 1
        for placement in plan.placements:
            if placement.status is PlacementStatus.REPLACED and placement.text not in shown:
                problems.append(f"{tenant}/{conversation} turn {plan.scope.turn}: {placement.hint}")
        shown.extend(p.text for p in plan.placements if p.shown)
    return received


def test_cancelled_calls_leave_no_hint_at_a_turn_never_received() -> None:
    config = ServiceConfig(
        tenants={name: TenantKeys((key,)) for name, key in KEYS.items()}, window_ms=20
    )
    problems: list[str] = []
    with serve_in_thread(create_app(config)) as base_url:
        # The test is about hints, not latency: a loaded CI machine may take longer than the
        # default 1 s read timeout to answer ten concurrent conversations through a window.
        timeout = httpx.Timeout(30.0, connect=5.0)
        clients = {
            name: ContextPilotClient(base_url, api_key=key, timeout=timeout)
            for name, key in KEYS.items()
        }

        async def run() -> list[int]:
            try:
                return await asyncio.gather(
                    *(
                        _conversation(client, tenant, f"c{j}", problems)
                        for tenant, client in clients.items()
                        for j in range(CONVERSATIONS)
                    )
                )
            finally:
                for client in clients.values():
                    await client.aclose()

        received = asyncio.run(run())
        counts = [client.stats()["client"] for client in clients.values()]
    assert sum(received) > 0
    assert all(count["service_failures"] == 0 for count in counts), counts
    assert not problems, problems


def test_a_forget_waits_for_a_plan_of_its_conversation_that_arrived_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan's ticket is taken (its request arrived), then a forget comes while the plan is
    still being made: the forget drops the turn that plan records, so the next plan hints at
    nothing."""
    service = IndexService(ServiceConfig(window_ms=20))
    store = service.pilot_of().deduplicator.store
    open_turn = store.open_turn

    @contextmanager
    def slow_open_turn(*args: Any, **kwargs: Any) -> Iterator[Any]:
        time.sleep(0.2)  # the plan is still being made when the forget arrives
        with open_turn(*args, **kwargs) as turn:
            yield turn

    monkeypatch.setattr(store, "open_turn", slow_open_turn)
    blocks = POOL[:4]
    ticket = service.in_flight.arrive()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            service.plan, PlanRequest("q1", blocks, scope=Scope("c")), ticket=ticket
        )
        assert service.forget_conversation("", "c")  # it waited for turn 1 to be recorded
        assert first.result(10).scope.turn == 1
    service.in_flight.done_reading(ticket)
    monkeypatch.setattr(store, "open_turn", open_turn)
    again = service.plan(PlanRequest("q2", blocks, scope=Scope("c")))
    assert again.scope.turn == 2
    assert not [p for p in again.placements if p.status is PlacementStatus.REPLACED]
