"""Turn numbers across service restarts: the service's boot id on every
answer, and a client that keeps the app's numbering when a service restarted without its
snapshot (or with a lost one) numbers a conversation afresh. No turn number is given twice and
no hint is ambiguous across a restart, with the fallback's rules (local plans never hint; a
conversation whose call failed after it was sent is forgotten before its next use) in force.

Real server processes for the restarts; a property test over random restarts, snapshot kinds
and failed calls with in-process apps (a restart is a new ``IndexService``), which is fast
enough for many examples.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_testing import free_port

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.client.conversations import ConversationMemory
from contextpilot_integrations.client.schemas import BOOT_HEADER
from contextpilot_integrations.core.conversations.turns import MAX_TURN
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import PlacementStatus, Plan
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.service.app import create_app
from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.service_config import ServiceConfig

PASSAGES = [f"passage {i}: " + " ".join(f"w{i}-{j}" for j in range(40)) for i in range(8)]
POINTER = re.compile(r"(\[Doc \d+\]) (?:of turn (\d+)|in this message)")


@dataclass
class App:
    """One conversation as the app shows it: each numbered turn's shown blocks by label."""

    conversation: str = field(default_factory=lambda: f"chat-{uuid.uuid4().hex}")
    turns: dict[int, dict[str, str]] = field(default_factory=dict)
    numbers: list[int] = field(default_factory=list)

    def receive(self, plan: Plan) -> Plan:
        """Check every hint and pointer of ``plan`` against what the app shows, then show it."""
        shown_now = {p.label: p.rendered_text for p in plan.blocks}
        places = [(p.hint or "", p.text) for p in plan.placements if p.hint]
        places += [(p.rendered_text or "", "") for p in plan.blocks if p.rendered_text != p.text]
        for where, replaced in places:
            named = POINTER.findall(where)
            assert named, where
            for label, turn in named:
                if not turn:
                    assert label in shown_now, where
                    continue
                shown = self.turns.get(int(turn), {})
                assert label in shown, f"{where!r}: the app's turn {turn} shows no {label}"
                assert not replaced or shown[label] == replaced, f"{where!r} names other text"
        turn = plan.scope.turn
        if turn is not None:
            assert not self.numbers or turn > self.numbers[-1], (turn, self.numbers)
            self.numbers.append(turn)
            self.turns[turn] = {p.label or "": p.rendered_text or "" for p in plan.blocks}
        return plan


def _boot(base_url: str) -> str:
    response = httpx.get(f"{base_url}/health", timeout=5.0)
    assert response.headers[BOOT_HEADER] == response.json()["boot_id"]
    return response.headers[BOOT_HEADER]


# ---------------------------------------------------------------------------------------------
# The boot id
# ---------------------------------------------------------------------------------------------


def test_every_answer_carries_the_boot_id_and_a_new_service_has_another() -> None:
    first = TestClient(create_app(ServiceConfig(api_key="key", max_body_bytes=1000)))
    boot = first.get("/health").json()["boot_id"]
    assert len(boot) == 16 and first.get("/health").headers[BOOT_HEADER] == boot
    authorised = {"authorization": "Bearer key"}
    answers = [
        first.get("/v1/stats"),  # 401
        first.get("/v1/stats", headers=authorised),
        first.get("/nowhere", headers=authorised),  # 404
        first.post("/v1/plan", content=b"{", headers=authorised),  # 422: not JSON
        first.post("/v1/plan", json={"query": 1, "blocks": []}, headers=authorised),  # 422
        first.post("/v1/plan", content=b"x" * 2000, headers=authorised),  # 413
    ]
    assert [a.status_code for a in answers] == [401, 200, 404, 422, 422, 413]
    assert {a.headers[BOOT_HEADER] for a in answers} == {boot}
    second = TestClient(create_app(ServiceConfig()))
    assert second.get("/health").json()["boot_id"] != boot


def test_the_numbering_rules_one_by_one() -> None:
    pilot = ContextPilot()
    memory = ConversationMemory(max_conversations=2)

    def answer(request: PlanRequest, turn: int | None, boot: str, *, hinted: bool = False):  # type: ignore[no-untyped-def]
        sent = memory.to_send(request)
        scope = Scope(f"p-{uuid.uuid4().hex}")
        plan = pilot.plan("q", [PASSAGES[0]], scope=scope)
        if hinted:  # a plan that points back
            plan = pilot.plan("q", [PASSAGES[0]], scope=scope)
            assert plan.hints
        plan = dataclasses.replace(plan, scope=dataclasses.replace(sent.scope, turn=turn))
        return sent, memory.received(request, sent, plan, boot)

    request = PlanRequest("q", [PASSAGES[0]], scope=Scope("c"))
    sent, got = answer(request, 4, "a")  # met first: the service's number stands
    assert sent == request and got.plan.scope.turn == 4 and not got.settle
    assert answer(request, 5, "a")[1].plan.scope.turn == 5
    assert answer(request, 2, "a")[1].plan.scope.turn == 2  # the same start: it stands
    assert answer(request, 3, "b")[1].plan.scope.turn == 3  # goes on after 2: stands
    sent, got = answer(request, 1, "c")  # another start, numbered afresh
    assert got.plan.scope.turn == 4 and got.settle == (("conversation", "", "c"),)
    sent, got = answer(request, 5, "c")  # from now on the client numbers the turns
    assert sent.scope.turn == 5 and got.plan.scope.turn == 5 and not got.settle
    own = PlanRequest("q", [PASSAGES[0]], scope=Scope("c", turn=9))
    assert answer(own, 9, "e")[0] == own  # the caller's own number is sent as it is
    assert memory.to_send(request).scope.turn == 10

    other = PlanRequest("q", [PASSAGES[0]], scope=Scope("other"))
    answer(other, 3, "a")
    sent, got = answer(other, None, "a")  # unnumbered (an amnesic store): nothing to forget
    assert sent == other and got.plan.scope.turn == 4 and not got.settle
    third = PlanRequest("q", [PASSAGES[0]], scope=Scope("third"))
    answer(third, 3, "a")
    sent, got = answer(third, 1, "b", hinted=True)  # points back: planned locally instead
    assert got.plan is None and got.turn == 4
    assert got.settle[0] == ("conversation", "", "third") and got.settle[1][0] == "rid"
    assert memory.to_send(third).scope.turn == 5
    counts = memory.counts()
    assert counts["renumbered"] == 2 and counts["renumber_refused"] == 1
    assert memory.counts()["conversations"] == 2  # the LRU bound: "c" is forgotten
    assert memory.to_send(request) == request


def test_the_clients_numbering_stops_at_the_largest_turn_with_a_clear_error() -> None:
    memory = ConversationMemory()
    pilot = ContextPilot()
    top = PlanRequest("q", [PASSAGES[0]], scope=Scope("c", turn=MAX_TURN))
    plan = pilot.plan("q", [PASSAGES[0]], scope=top.scope)
    memory.received(top, top, plan, "a")
    unnumbered = PlanRequest("q", [PASSAGES[1]], scope=Scope("c"))
    restarted = pilot.plan("q", [PASSAGES[1]], scope=Scope("fresh"))  # numbered 1 afresh
    restarted = dataclasses.replace(restarted, scope=dataclasses.replace(restarted.scope, turn=1))
    with pytest.raises(ValueError, match="'c' is at turn 2147483647") as refused:
        memory.received(unnumbered, unnumbered, restarted, "b")
    assert str(MAX_TURN + 1) not in str(refused.value)
    # What the restarted service recorded is undone before the conversation's next call.
    assert memory.unsettled_among([("conversation", "", "c")]) == [("conversation", "", "c")]
    # A client that numbers the conversation itself (after a restart) stops there too.
    numbered = ConversationMemory()
    below = PlanRequest("q", [PASSAGES[0]], scope=Scope("c", turn=MAX_TURN - 1))
    numbered.received(below, below, dataclasses.replace(plan, scope=below.scope), "a")
    renumbered = numbered.received(unnumbered, unnumbered, restarted, "b").plan
    assert renumbered is not None and renumbered.scope.turn == MAX_TURN
    with pytest.raises(ValueError, match="'c' is at turn 2147483647") as refused:
        numbered.to_send(unnumbered)
    assert str(MAX_TURN + 1) not in str(refused.value)


# ---------------------------------------------------------------------------------------------
# Real servers, restarted
# ---------------------------------------------------------------------------------------------


def test_a_restart_without_a_snapshot_reuses_no_turn_number(server_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    first = server_factory(port=port)
    client = ContextPilotClient(first.base_url, retry_interval_s=0.0)
    app = App()
    scope = Scope(app.conversation)

    def turn(query: str, picks: list[int]) -> Plan:
        return app.receive(client.plan(query, [PASSAGES[i] for i in picks], scope=scope))

    assert turn("one", [0, 1]).scope.turn == 1
    assert turn("two", [0, 2]).hints  # [Doc 1] of turn 1
    before = _boot(first.base_url)
    first.stop(signal.SIGTERM)  # no --snapshot: the conversation store is gone

    second = server_factory(port=port)  # the client follows it on the same port
    assert _boot(second.base_url) != before
    three = turn("three", [0, 1, 3])
    assert three.scope.turn == 3 and not three.hints  # the service's 1, renumbered
    # Its records went with the forget (they carried the service's number 1): turn 4 is sent
    # in full, and recorded under the app's number.
    four = turn("four", [1, 3, 4])
    assert four.scope.turn == 4 and not four.hints
    five = turn("five", [3, 4, 5])
    assert five.scope.turn == 5 and len(five.hints) == 2  # [Doc 2], [Doc 3] of turn 4
    assert all("of turn 4" in hint for hint in five.hints)
    counters = client.stats()["client"]
    assert counters["renumbered"] == 1 and counters["renumber_refused"] == 0
    assert counters["unsettled"] == 0 and counters["settled"] == 1  # forgotten on the service
    assert app.numbers == [1, 2, 3, 4, 5]

    # The service holds the app's numbers now: a client that remembers nothing (another
    # process of the app) is numbered on from them.
    with ContextPilotClient(second.base_url, fallback=False) as other:
        six = app.receive(other.plan("six", [PASSAGES[5], PASSAGES[6]], scope=scope))
    assert six.scope.turn == 6 and six.hints
    client.close()


def test_a_restart_with_a_final_snapshot_changes_nothing(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    snapshot = str(tmp_path / "index.json")
    first = server_factory("--snapshot", snapshot, port=port)
    client = ContextPilotClient(first.base_url, retry_interval_s=0.0)
    app = App()
    scope = Scope(app.conversation)
    for query, picks in (("one", [0, 1]), ("two", [1, 2])):
        app.receive(client.plan(query, [PASSAGES[i] for i in picks], scope=scope))
    first.stop(signal.SIGTERM)  # the final snapshot: the store comes back whole

    server_factory("--snapshot", snapshot, port=port)
    three = app.receive(client.plan("three", [PASSAGES[0], PASSAGES[2]], scope=scope))
    assert three.scope.turn == 3 and len(three.hints) == 2  # turns 1 and 2 still pointed to
    counters = client.stats()["client"]
    assert counters["renumbered"] == 0 and counters["settled"] == 0


def test_a_restart_whose_snapshot_was_lost_numbers_on_from_the_app(
    server_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    port = free_port()
    snapshot = tmp_path / "index.json"
    first = server_factory("--snapshot", str(snapshot), port=port)
    client = ContextPilotClient(first.base_url, retry_interval_s=0.0)
    app = App()
    scope = Scope(app.conversation)
    for query, picks in (("one", [0, 1]), ("two", [1, 2])):
        app.receive(client.plan(query, [PASSAGES[i] for i in picks], scope=scope))
    first.stop(signal.SIGTERM)
    snapshot.write_text("{lost")  # set aside at start: the stores are amnesic

    server_factory("--snapshot", str(snapshot), port=port)
    three = app.receive(client.plan("three", [PASSAGES[0], PASSAGES[3]], scope=scope))
    assert three.scope.turn == 3 and not three.hints  # unnumbered by the service
    four = app.receive(client.plan("four", [PASSAGES[3], PASSAGES[4]], scope=scope))
    assert four.scope.turn == 4 and not four.hints  # turn 3 recorded nothing to point to
    five = app.receive(client.plan("five", [PASSAGES[4], PASSAGES[5]], scope=scope))
    assert five.scope.turn == 5 and all("of turn 4" in hint for hint in five.hints)
    assert five.hints
    assert client.stats()["client"]["renumbered"] == 1


def test_a_plan_that_points_back_is_planned_locally_not_renumbered(server_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    first = server_factory(port=port)
    client = ContextPilotClient(first.base_url, retry_interval_s=0.0)
    app = App()
    scope = Scope(app.conversation)
    for query, picks in (("one", [0, 1]), ("two", [1, 2])):
        app.receive(client.plan(query, [PASSAGES[i] for i in picks], scope=scope))
    first.stop(signal.SIGTERM)

    second = server_factory(port=port)
    # Another process plans the conversation on the new service first (its turn 1 there),
    # which this client cannot see: the service's next plan hints to it.
    with ContextPilotClient(second.base_url, fallback=False) as other:
        other.plan("elsewhere", [PASSAGES[0], PASSAGES[1]], scope=scope)
    rid = f"refused-{uuid.uuid4().hex}"
    three = app.receive(client.plan("three", [PASSAGES[0], PASSAGES[3]], scope=scope, rid=rid))
    assert three.scope.turn == 3 and not three.hints  # planned locally, under the next number
    assert all(p.status is PlacementStatus.SHOWN for p in three.placements)
    counters = client.stats()["client"]
    assert counters["renumber_refused"] == 1 and counters["fallback_plans"] == 1
    assert counters["unsettled"] == 0 and counters["settled"] == 2
    assert client.evict(rid) is False  # evicted from the service at once
    four = app.receive(client.plan("four", [PASSAGES[3], PASSAGES[4]], scope=scope))
    assert four.scope.turn == 4 and not four.hints  # forgotten on the service: nothing to hint
    client.close()


# ---------------------------------------------------------------------------------------------
# Property: random restarts, snapshot kinds and failed calls
# ---------------------------------------------------------------------------------------------


class RestartingService(httpx.BaseTransport):
    """An in-process service behind a transport: ``restart(kind)`` replaces it by a new one
    (a new boot id), and each request can fail as told.

    Restart kinds: ``"fresh"`` (no snapshot), ``"final"`` (stopped, final snapshot restored),
    ``"checkpoint"`` (a checkpoint saved, then killed), ``"killed"`` (killed without a save:
    history lost), ``"lost"`` (the snapshot file unreadable). After a ``"fresh"`` one, the next
    restart with the snapshot finds the file of before (an operator who once started the
    service without ``--snapshot``). Faults: ``"refused"`` (never
    sent), ``"timeout"`` (planned and recorded, the answer lost), ``"5xx"`` (a proxy's 502 after
    the service answered).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "index.json"
        self.faults: list[str] = []
        self._start(self.path)

    def _start(self, path: Path | None) -> None:
        self.service = IndexService(ServiceConfig(snapshot_path=path))
        self.service.start()
        self.http = TestClient(create_app(service=self.service))

    def restart(self, kind: str) -> None:
        if kind == "final":
            self.service.stop()
        elif kind == "checkpoint":
            self.service.save_snapshot()  # False on a service started without the snapshot
        elif kind == "lost":
            self.service.stop()
            self.path.write_text("{lost")
        if kind == "fresh":
            self._start(None)
        else:
            self._start(self.path)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        fault = self.faults.pop(0) if self.faults and request.url.path != "/v1/layout" else "ok"
        if fault == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        response = self.http.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        if fault == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if fault == "5xx":
            return httpx.Response(502, json={"message": "bad gateway"}, request=request)
        return httpx.Response(
            response.status_code, headers=response.headers, content=response.content
        )


STEP = st.one_of(
    st.tuples(
        st.just("plan"),
        st.integers(0, 2),  # which conversation
        st.lists(st.integers(0, len(PASSAGES) - 1), min_size=1, max_size=4, unique=True),
        st.sampled_from(["ok", "ok", "ok", "ok", "timeout", "5xx", "refused"]),
        st.booleans(),  # as a batch
    ),
    st.tuples(
        st.just("restart"),
        st.sampled_from(["fresh", "fresh", "final", "checkpoint", "killed", "lost"]),
    ),
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=st.lists(STEP, min_size=4, max_size=24), forget_fails=st.booleans())
def test_no_turn_number_twice_and_no_ambiguous_hint_across_restarts(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple], forget_fails: bool
) -> None:
    service = RestartingService(tmp_path_factory.mktemp("restarting"))
    client = ContextPilotClient("http://service.test", retry_interval_s=0.0, transport=service)
    apps = [App() for _ in range(3)]
    for step in steps:
        if step[0] == "restart":
            service.restart(step[1])
            continue
        _, which, picks, fault, batch = step
        app = apps[which]
        # a failed plan may be followed by a failed forget of it (the next settle)
        service.faults = [fault] + (["timeout"] if forget_fails and fault != "ok" else [])
        texts = [PASSAGES[i] for i in picks]
        scope = Scope(app.conversation)
        if batch:
            plan = client.plan_batch([PlanRequest("q", texts, scope=scope)]).plans[0]
        else:
            plan = client.plan("q", texts, scope=scope)
        assert sorted(p.index for p in plan.placements) == list(range(len(texts)))
        app.receive(plan)
        if plan.scope.turn is None:  # only a local plan comes back unnumbered here
            assert not plan.hints and all(p.shown for p in plan.placements)
        service.faults = []
    client.close()
    service.service.stop()


def test_without_the_clients_memory_a_restart_gives_turn_1_twice(tmp_path: Path) -> None:
    """The property above is not vacuous: a client made anew for each turn (the residual
    case: the app must pass ``Scope.turn``) gets turn 1 twice across a fresh restart."""
    service = RestartingService(tmp_path)
    app = App()

    def turn() -> Plan:
        with ContextPilotClient("http://service.test", transport=service) as client:
            return client.plan("q", PASSAGES[:2], scope=Scope(app.conversation))

    app.receive(turn())
    service.restart("fresh")
    with pytest.raises(AssertionError, match=r"\(1, \[1\]\)"):
        app.receive(turn())
    service.service.stop()
