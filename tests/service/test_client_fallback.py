"""The client when the service fails: short timeouts for plans (a
server that accepts connections but never answers costs about a second), local plans that
never hint, and no hint to a turn the app did not receive, across a service that records a
turn and then times out."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_testing import blocks_of, check_hints

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.client.errors import ServiceUnavailableError
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.request import PlanRequest, Scope


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP server that accepts connections (the kernel completes the handshake) and never
    reads or answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_server_that_never_answers_costs_about_a_second(silent_server: str) -> None:
    client = ContextPilotClient(silent_server, retry_interval_s=60.0)
    started = time.perf_counter()
    plan = client.plan("q", blocks_of(1))
    waited = time.perf_counter() - started
    assert sorted(plan.order) == list(range(len(blocks_of(1))))  # the local plan
    assert waited < 2.5, waited  # the plan's default read timeout is 1 s
    assert client.stats()["client"]["fallback_plans"] == 1
    strict = ContextPilotClient(silent_server, fallback=False, timeout=0.3)
    started = time.perf_counter()
    with pytest.raises(ServiceUnavailableError):
        strict.plan("q", ["a block"])
    assert time.perf_counter() - started < 1.5
    # Batches, statistics and saves may wait longer (a large build takes seconds).
    default = ContextPilotClient(silent_server)
    assert default.plan_timeout.as_dict() == {
        "connect": 0.5,
        "read": 1.0,
        "write": 1.0,
        "pool": 1.0,
    }
    assert default.batch_timeout.read == 30.0
    custom = ContextPilotClient(silent_server, timeout=2.0, batch_timeout=90.0)
    assert custom.plan_timeout.read == 2.0 and custom.batch_timeout.read == 90


def test_local_plans_never_hint(unreachable_url: str) -> None:
    client = ContextPilotClient(unreachable_url, retry_interval_s=0.0)
    texts = blocks_of(3)
    first = client.plan("one", texts, scope=Scope("chat"))
    second = client.plan("two", texts, scope=Scope("chat"))
    assert not second.hints and all(p.shown for p in second.placements)
    assert second.scope == Scope("chat") and first.scope.turn is None  # no number invented
    explicit = client.plan("three", texts, scope=Scope("chat", turn=3))
    assert explicit.scope.turn == 3 and not explicit.hints
    batch = client.plan_batch([PlanRequest("four", texts, scope=Scope("chat", turn=4))])
    assert batch.plans[0].scope.turn == 4 and not batch.plans[0].hints


class FlakyTransport(httpx.BaseTransport):
    """Sends to the real server, then fails as told: ``"ok"``, ``"refused"`` (never sent),
    ``"timeout"`` (sent and planned, the answer lost), ``"5xx"`` (sent, then a proxy's 502)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.next_plan = "ok"
        self.next_forget = "ok"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        action = "ok"
        if path in ("/v1/plan", "/v1/plan_batch"):
            action, self.next_plan = self.next_plan, "ok"
        elif path == "/v1/conversations/forget":
            action, self.next_forget = self.next_forget, "ok"
        if action == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        response = self.inner.handle_request(request)
        response.read()
        if action == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if action == "5xx":
            return httpx.Response(502, json={"message": "bad gateway"}, request=request)
        return response


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["ok", "ok", "timeout", "5xx", "refused"]),
            st.sampled_from(["ok", "ok", "timeout"]),
            st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
            st.booleans(),
        ),
        min_size=2,
        max_size=9,
    ),
    explicit=st.booleans(),
)
def test_no_hint_points_at_a_turn_the_app_did_not_receive(
    shared_server,  # type: ignore[no-untyped-def]
    steps: list[tuple[str, str, list[int], bool]],
    explicit: bool,
) -> None:
    transport = FlakyTransport()
    client = ContextPilotClient(shared_server.base_url, retry_interval_s=0.0, transport=transport)
    conversation = f"chat-{uuid.uuid4().hex}"
    pool = [f"passage {uuid.uuid4().hex[:6]} {i}: " + "text " * 30 for i in range(6)]
    received: dict[int, Plan] = {}
    numbers: list[int] = []
    for number, (plan_fault, forget_fault, picks, batch) in enumerate(steps, start=1):
        transport.next_plan, transport.next_forget = plan_fault, forget_fault
        scope = Scope(conversation, turn=number if explicit else None)
        texts = [pool[i] for i in picks]
        if batch:
            plan = client.plan_batch([PlanRequest(f"q{number}", texts, scope=scope)]).plans[0]
        else:
            plan = client.plan(f"q{number}", texts, scope=scope)
        assert sorted(p.index for p in plan.placements) == list(range(len(texts)))
        check_hints(plan, received)
        if plan.scope.turn is not None:
            numbers.append(plan.scope.turn)
            received[plan.scope.turn] = plan
    assert numbers == sorted(set(numbers)), f"a turn number came back twice: {numbers}"
    client.close()


def test_a_failed_forget_plans_locally_and_is_retried(shared_server) -> None:  # type: ignore[no-untyped-def]
    transport = FlakyTransport()
    client = ContextPilotClient(shared_server.base_url, retry_interval_s=0.0, transport=transport)
    scope = Scope(f"chat-{uuid.uuid4().hex}")
    texts = blocks_of(11)
    client.plan("one", texts, scope=scope)
    transport.next_plan = "timeout"  # turn 2 is recorded by the service, never received
    phantom = client.plan("two", texts, scope=scope)
    assert phantom.scope.turn is None and not phantom.hints  # the local plan
    assert client.stats()["client"]["unsettled"] == 1
    transport.next_forget = "timeout"  # the forget fails: plan locally again
    again = client.plan("three", texts, scope=scope)
    assert again.scope.turn is None and not again.hints
    fresh = client.plan("four", texts, scope=scope)  # forgotten now: the service plans it
    assert fresh.scope.turn is not None and fresh.scope.turn > 2 and not fresh.hints
    counters = client.stats()["client"]
    assert counters["unsettled"] == 0 and counters["settled"] == 1
    # A retried explicit rid whose first try timed out after the service indexed it.
    transport.next_plan = "timeout"
    rid = f"retried-{uuid.uuid4().hex}"
    client.plan("q", ["a block"], rid=rid)
    assert client.stats()["client"]["unsettled"] == 1
    assert client.plan("q", ["a block"], rid=rid).rid == rid  # evicted first: no 409
