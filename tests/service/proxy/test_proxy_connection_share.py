"""The upstream pool shared between tenants (docs/DESIGN.md, "The proxy"): one tenant's slow
calls never take the connections another tenant's call needs, a call that finds no free
connection within the pool timeout is a 503 with Retry-After and nothing is sent, and a slot
is given back however a call ends (answered, cancelled while waiting or streaming, the
upstream unreachable)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from proxy_testing import closed_port_url, serve_proxy
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support.asgi_server import serve_in_thread

from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.proxy.connection_gate import ConnectionGate, PoolBusy
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.service_config import ServiceConfig
from contextpilot_integrations.service.tenants import TenantKeys

_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
}


class SlowUpstream:
    """An upstream whose ``hold`` calls (model ``hold``, or ``?hold=1`` on ``/v1/models``)
    answer only once ``release`` is set; counts the calls in flight by ``x-who``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.received: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self._lock = threading.Lock()

    async def _held(self, request: Request, hold: bool) -> JSONResponse:
        who = request.headers.get("x-who", "")
        with self._lock:
            self.received[who] += 1
            self.in_flight[who] += 1
            self.peak[who] = max(self.peak[who], self.in_flight[who])
        try:
            while hold and not self.release.is_set():
                await asyncio.sleep(0.01)
            return JSONResponse(_ANSWER)
        finally:
            with self._lock:
                self.in_flight[who] -= 1

    def app(self) -> Starlette:
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            return await self._held(request, body.get("model") == "hold")

        async def models(request: Request) -> JSONResponse:
            return await self._held(request, request.query_params.get("hold") == "1")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


@pytest.fixture
def upstream() -> Iterator[tuple[str, SlowUpstream]]:
    state = SlowUpstream()
    with serve_in_thread(state.app()) as url:
        try:
            yield url, state
        finally:
            state.release.set()


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def _post(
    client: httpx.AsyncClient, model: str, who: str, key: str | None = None
) -> httpx.Response:
    headers = {"x-who": who}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return await client.post("/v1/chat/completions", json=_chat(model), headers=headers)


TENANTS = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}


def test_one_tenant_never_takes_the_connections_another_needs(upstream) -> None:  # type: ignore[no-untyped-def]
    url, state = upstream
    proxy_settings = {"max_connections": 8, "pool_timeout_s": 20.0}
    with serve_proxy(url, proxy_settings, tenants=TENANTS) as proxy:

        async def run() -> None:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=proxy, timeout=30, limits=limits) as client:
                alice = [
                    asyncio.create_task(_post(client, "hold", "alice", "alice-key"))
                    for _ in range(12)
                ]
                while state.in_flight["alice"] < 6:
                    await asyncio.sleep(0.01)
                # Alice holds her share (8 less a quarter) and waits for more; Bob's call
                # goes out on the connections left, while hers are still held.
                bob = await asyncio.wait_for(_post(client, "quick", "bob", "bob-key"), 5.0)
                assert bob.status_code == 200
                passed = await client.get(
                    "/v1/models",
                    headers={"x-who": "bob", "authorization": "Bearer bob-key"},
                )
                assert passed.status_code == 200  # a passed-through call counts too
                assert state.in_flight["alice"] == 6 and not state.release.is_set()
                state.release.set()
                answers = await asyncio.gather(*alice)
                assert [a.status_code for a in answers] == [200] * 12

        asyncio.run(run())
    assert state.peak["alice"] == 6 and state.received["alice"] == 12


def test_a_call_past_the_pool_timeout_is_a_503_and_nothing_is_sent(upstream) -> None:  # type: ignore[no-untyped-def]
    url, state = upstream
    with serve_proxy(url, {"max_connections": 2, "pool_timeout_s": 0.3}) as proxy:

        async def run() -> tuple[httpx.Response, httpx.Response, str]:
            async with httpx.AsyncClient(base_url=proxy, timeout=30) as client:
                held = [asyncio.create_task(_post(client, "hold", "a")) for _ in range(2)]
                while state.in_flight["a"] < 2:
                    await asyncio.sleep(0.01)
                refused = await _post(client, "quick", "late")
                messages = await client.post(
                    "/v1/messages",
                    json={"model": "quick", "max_tokens": 1, "messages": [
                        {"role": "user", "content": "hi"}]},
                    headers={"x-who": "late"},
                )  # fmt: skip
                metrics = (await client.get("/metrics")).text
                state.release.set()
                assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
                return refused, messages, metrics

        refused, messages, metrics = asyncio.run(run())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "upstream_busy" and "no upstream connection free" in error["message"]
    assert messages.status_code == 503
    assert messages.json()["error"]["type"] == "overloaded_error"
    assert state.received["late"] == 0
    assert 'contextpilot_proxy_upstream_failures_total{kind="pool_timeout"} 2.0' in metrics
    assert 'contextpilot_proxy_requests_total{endpoint="chat_completions",status="503"}' in metrics


def test_no_slot_is_lost_to_cancelled_calls(upstream) -> None:  # type: ignore[no-untyped-def]
    url, state = upstream
    config = ServiceConfig(proxy=ProxyConfig(url, max_connections=4, pool_timeout_s=20.0))
    app = create_app(config)
    with serve_in_thread(app, lifespan="on") as proxy:

        async def run() -> None:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=proxy, timeout=30, limits=limits) as client:
                # Four calls hold the pool, twenty wait for it; every one of them is
                # cancelled by its client (those streaming and those waiting).
                calls = [asyncio.create_task(_post(client, "hold", f"gone-{i}")) for i in range(24)]
                while sum(state.in_flight.values()) < 4:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the others wait at the gate
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
            gate = app.state.proxy.upstream.gate
            while gate.free < 4:  # the proxy sees each disconnect
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=proxy, timeout=30, limits=limits) as client:
                again = [asyncio.create_task(_post(client, "hold", "again")) for _ in range(4)]
                while state.in_flight["again"] < 4:
                    await asyncio.sleep(0.01)
                state.release.set()
                assert [r.status_code for r in await asyncio.gather(*again)] == [200] * 4

        asyncio.run(asyncio.wait_for(run(), 20))
    # The four holders went out. A waiting call handed a slot that a holder's hang-up freed
    # before its own hang-up reached the proxy goes out too (nothing on the wire says yet that
    # its client left); what must hold is that none goes out twice and no slot is lost.
    assert sum(state.received[f"gone-{i}"] for i in range(24)) >= 4
    assert all(state.received[f"gone-{i}"] <= 1 for i in range(24))
    assert app.state.proxy.upstream.gate.free == 4


def test_an_unreachable_upstream_gives_its_slot_back() -> None:
    with serve_proxy(closed_port_url(), {"max_connections": 1, "pool_timeout_s": 0.5}) as proxy:
        statuses = [
            httpx.post(f"{proxy}/v1/chat/completions", json=_chat("m"), timeout=10).status_code
            for _ in range(3)
        ]
    assert statuses == [502, 502, 502]


def test_a_freed_slot_goes_to_the_waiting_tenant_holding_the_fewest() -> None:
    async def run() -> list[str]:
        gate = ConnectionGate(capacity=4, tenant_cap=3, timeout_s=5.0)
        for tenant in ("a", "a", "a", "b"):
            await gate.acquire(tenant)
        order: list[str] = []

        async def wait(tenant: str) -> None:
            await gate.acquire(tenant)
            order.append(tenant)

        waiting = [asyncio.create_task(wait(t)) for t in ("a", "a", "b")]
        await asyncio.sleep(0)
        gate.release("a")  # a holds 2, b 1: b's turn
        await asyncio.sleep(0)
        gate.release("a")  # a holds 1, b 2: a's turn
        await asyncio.sleep(0)
        gate.release("b")  # a holds 2, b 1, only a waits
        await asyncio.gather(*waiting)
        assert (gate.held("a"), gate.held("b"), gate.free) == (3, 1, 0)
        return order

    assert asyncio.run(run()) == ["b", "a", "a"]


def test_a_tenant_at_its_cap_waits_even_with_free_slots_and_times_out() -> None:
    async def run() -> None:
        gate = ConnectionGate(capacity=4, tenant_cap=2, timeout_s=0.05)
        await gate.acquire("a")
        await gate.acquire("a")
        # Its own share ran out, not the pool: the message says so.
        with pytest.raises(PoolBusy, match=r"hold their share .*\(2 of 4\).* within 0.05 s"):
            await gate.acquire("a")
        await gate.acquire("b")  # free slots are left for others
        await gate.acquire(None)  # a call without a tenant is not capped
        assert gate.free == 0
        for tenant in ("a", "a", "b", None):
            gate.release(tenant)
        assert gate.free == 4

    asyncio.run(run())


@pytest.mark.parametrize(("pool", "share"), [(1, 1), (2, 1), (3, 2), (4, 3), (8, 6), (512, 384)])
def test_the_default_share_leaves_the_others_a_connection(pool: int, share: int) -> None:
    assert ProxyConfig("http://127.0.0.1:1/v1", max_connections=pool).tenant_connections == share
