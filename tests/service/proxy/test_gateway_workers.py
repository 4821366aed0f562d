"""The gateway's workers as the fleet's replicas (docs/DESIGN.md, "The proxy"): each replica's
worker index is learnt from the gateway's answers before a call is targeted, a gateway that
does not honour the index is never targeted, and a targeted call that lands elsewhere turns
targeting off; the gateway's answer header moves a call at once. The probes and the stand-in
gateway here answer as SMG does (the worker URL of the index, or what a round-robin gateway
would name); the real gateway is in tests/testbed/test_proxy_smg_replicas.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from support.asgi_server import serve_in_thread

from contextpilot_integrations.core.replicas.routing_config import ReplicaSpec
from contextpilot_integrations.service.proxy import gateway_workers
from contextpilot_integrations.service.proxy.fleet_config import FleetConfig
from contextpilot_integrations.service.proxy.gateway_workers import (
    ROUTED_WORKER_HEADER,
    TARGET_WORKER_HEADER,
    GatewayWorkers,
)

URLS = {"a": "http://127.0.0.1:8001", "b": "http://127.0.0.1:8002"}
SPECS = [ReplicaSpec("a", f"{URLS['a']}/v1"), ReplicaSpec("b", f"{URLS['b']}/")]


def _probe(answer: Callable[[int], str | None]) -> gateway_workers.Probe:
    async def probe(index: int) -> str | None:
        return answer(index)

    return probe


def test_an_honoured_index_is_learnt_and_sent_with_the_replicas_calls() -> None:
    workers = GatewayWorkers(SPECS, enabled=True)
    assert workers.state == "pending" and workers.headers("a") == []
    # The gateway's own order: index 0 is replica b's worker.
    asyncio.run(workers.calibrate(_probe(lambda i: [URLS["b"], URLS["a"]][i])))
    assert workers.stats() == {"state": "on", "workers": {"b": 0, "a": 1}, "reason": "",
                               "misrouted": 0, "recalibrations": 0}  # fmt: skip
    assert workers.headers("a") == [(TARGET_WORKER_HEADER, "1")]
    assert workers.headers("b") == [(TARGET_WORKER_HEADER, "0")]
    # A worker URL names its replica however the replica's base_url was written.
    assert workers.replica_at("HTTP://127.0.0.1:8002/v1/") == "b"
    assert workers.replica_at("http://127.0.0.1:9999") is None


def test_a_gateway_that_alternates_its_workers_is_never_targeted() -> None:
    workers = GatewayWorkers(SPECS, enabled=True)
    turns = itertools.cycle([URLS["a"], URLS["b"]])  # round robin ignores the index
    asyncio.run(workers.calibrate(_probe(lambda i: next(turns))))
    assert workers.state == "off" and "consistent_hashing" in workers.stats()["reason"]
    assert workers.headers("a") == workers.headers("b") == []


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (lambda i: None, "did not send each worker index"),  # no worker named
        (lambda i: URLS["a"], "do not name each replica once"),  # one worker for every index
        (lambda i: "http://127.0.0.1:9999", "did not send each worker index"),  # not ours
    ],
)
def test_answers_that_do_not_map_the_indexes_one_to_one_leave_targeting_off(
    answer: Callable[[int], str | None], words: str
) -> None:
    workers = GatewayWorkers(SPECS, enabled=True)
    asyncio.run(workers.calibrate(_probe(answer)))
    assert workers.state == "off" and words in workers.stats()["reason"]


def test_a_gateway_not_up_yet_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_workers, "RETRY_S", 0.0)
    calls = []

    async def probe(index: int) -> str | None:
        calls.append(index)
        if len(calls) <= 3:
            raise OSError("connection refused")
        return URLS["a"] if index == 0 else URLS["b"]

    workers = GatewayWorkers(SPECS, enabled=True)
    asyncio.run(workers.calibrate(probe))
    assert workers.stats()["workers"] == {"a": 0, "b": 1}


def test_a_gateway_that_never_answers_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_workers, "RETRY_S", 0.0)

    async def probe(index: int) -> str | None:
        raise OSError("connection refused")

    workers = GatewayWorkers(SPECS, enabled=True)
    asyncio.run(workers.calibrate(probe))
    assert workers.state == "off" and "did not answer" in workers.stats()["reason"]


def test_a_targeted_call_that_lands_elsewhere_turns_targeting_off() -> None:
    workers = GatewayWorkers(SPECS, enabled=True)
    asyncio.run(workers.calibrate(_probe(lambda i: [URLS["a"], URLS["b"]][i])))
    # Where it went is read from the answer, targeted or not.
    assert workers.check("a", True, {ROUTED_WORKER_HEADER: URLS["a"]}) == "a"
    assert workers.check("a", False, {ROUTED_WORKER_HEADER: URLS["b"]}) == "b"
    assert workers.check("a", True, {}) is None
    assert workers.state == "on"
    assert workers.check("a", True, {ROUTED_WORKER_HEADER: URLS["b"]}) == "b"
    assert workers.stats()["state"] == "off" and workers.stats()["misrouted"] == 1
    assert "reached replica 'b'" in workers.stats()["reason"]
    assert workers.headers("a") == []


def test_a_targeted_call_the_gateway_has_no_worker_for_turns_targeting_off() -> None:
    workers = GatewayWorkers(SPECS, enabled=True)
    asyncio.run(workers.calibrate(_probe(lambda i: [URLS["a"], URLS["b"]][i])))
    refused = {"x-smg-error-code": "no_available_workers"}
    assert workers.check("a", False, refused) is None and workers.state == "on"
    assert workers.check("a", True, refused) is None
    assert workers.state == "off" and "no worker for replica 'a'" in workers.stats()["reason"]


def test_not_enabled_it_probes_nothing_and_targets_nothing() -> None:
    workers = GatewayWorkers(SPECS, enabled=False)

    async def probe(index: int) -> str | None:
        raise AssertionError("probed")

    asyncio.run(workers.calibrate(probe))
    assert workers.state == "off" and workers.headers("a") == []
    # Where an answer says a call went is still read.
    assert workers.check("a", False, {ROUTED_WORKER_HEADER: URLS["b"]}) == "b"


def test_targeting_needs_the_gateway_mode() -> None:
    direct = {"mode": "direct", "replicas": [{"name": "a", "base_url": URLS["a"]}]}
    with pytest.raises(ValueError, match="fleet.target_workers needs the gateway mode"):
        FleetConfig.from_mapping({**direct, "target_workers": True})
    with pytest.raises(ValueError, match="fleet.target_workers must be true or false, got 1"):
        FleetConfig.from_mapping({"mode": "gateway", "replicas": [{"name": "a"}],
                                  "target_workers": 1})  # fmt: skip
    gateway = FleetConfig.from_mapping(
        {"mode": "gateway", "replicas": [{"name": "a"}], "target_workers": True}
    )
    assert gateway.target_workers


def _gateway_app(url: str, target_workers: bool) -> Any:
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
    from contextpilot_integrations.service.service_config import ServiceConfig

    fleet = {
        "mode": "gateway",
        "replicas": [{"name": name, "base_url": f"{u}/v1"} for name, u in URLS.items()],
        "target_workers": target_workers,
    }
    return create_app(ServiceConfig(proxy=ProxyConfig(f"{url}/v1", fleet=fleet)))  # type: ignore[arg-type]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not condition():
        time.sleep(0.02)
    return condition()


def _call(proxy: str, session: str, **headers: str) -> Any:
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0, timeout=20)
    return client.chat.completions.with_raw_response.create(
        model="plain",
        messages=[{"role": "user", "content": "Q"}],
        extra_headers={"x-contextpilot-session": session, **headers},
    )


def test_the_gateways_answer_moves_a_call_to_the_replica_it_names(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    state.workers = [URLS["b"]]  # the gateway sends everything to replica b's worker
    app = _gateway_app(url, target_workers=False)
    with serve_in_thread(app, lifespan="on", start_timeout_s=10) as proxy:
        router = app.state.proxy.routing.router_of(None)
        planned, rids = [], []
        for n in range(2):
            raw = _call(proxy, f"c{n}")
            planned.append(raw.headers["x-contextpilot-replica"])
            rids.append(raw.headers["x-contextpilot-rid"])
            # The answer named b's worker: the router knows at once, no KV events needed.
            assert _wait_for(lambda: router.replica_of(rids[-1]) == "b")
        # An idle fleet: the first replica; then b holds the first call's load: a again.
        assert planned == ["a", "a"]
        assert router.stats()["routing"]["remapped"] == 2
    # Not asked to target: no calibration call, no target header, no SMG key header.
    assert all("x-smg-target-worker" not in r.headers for r in state.received)
    assert all("x-smg-routing-key" not in r.headers for r in state.received)


def test_calls_carry_their_replicas_worker_index_once_learnt(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    state.workers = [URLS["b"], URLS["a"]]  # the gateway's own order: index 0 is b
    app = _gateway_app(url, target_workers=True)
    with serve_in_thread(app, lifespan="on", start_timeout_s=10) as proxy:
        routing = app.state.proxy.routing
        assert _wait_for(lambda: routing.workers.state != "pending")
        assert routing.workers.stats()["workers"] == {"b": 0, "a": 1}
        calibration = len(state.received)
        raws = [_call(proxy, f"c{n}") for n in range(2)]
        router = routing.router_of(None)
        for raw in raws:
            planned = raw.headers["x-contextpilot-replica"]
            assert raw.headers["x-smg-routed-worker-id"] == URLS[planned]
            assert router.replica_of(raw.headers["x-contextpilot-rid"]) == planned
        calls = state.received[calibration:]
        assert sorted(r.headers["x-smg-target-worker"] for r in calls) == ["0", "1"]
        # The routing key goes in SMG's own header too: what it sticks by once untargeted.
        assert all(r.headers["x-smg-routing-key"] == r.headers["x-contextpilot-route"]
                   for r in calls)  # fmt: skip
        assert router.stats()["routing"]["remapped"] == 0


def test_a_clients_own_gateway_controls_are_dropped(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    state.workers = [URLS["a"], URLS["b"]]
    app = _gateway_app(url, target_workers=True)
    hostile = {"x-smg-target-worker": "1", "x-smg-routing-key": "mine"}
    with serve_in_thread(app, lifespan="on", start_timeout_s=10) as proxy:
        routing = app.state.proxy.routing
        assert _wait_for(lambda: routing.workers.state != "pending")
        calibration = len(state.received)
        raws = [_call(proxy, f"c{n}", **hostile) for n in range(2)]
        # Each call reached the replica planned for it, not the client's worker 1, so
        # targeting stays on for every tenant.
        assert [r.headers["x-smg-routed-worker-id"] for r in raws] == [
            URLS[r.headers["x-contextpilot-replica"]] for r in raws
        ]
        assert routing.workers.state == "on"
    # The stand-in reads the first of repeated headers: the proxy's, not the client's.
    calls = state.received[calibration:]
    assert sorted(r.headers["x-smg-target-worker"] for r in calls) == ["0", "1"]
    assert all(r.headers["x-smg-routing-key"] == r.headers["x-contextpilot-route"]
               for r in calls)  # fmt: skip


def test_targeting_turned_off_is_recalibrated_after_a_back_off(  # type: ignore[no-untyped-def]
    standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_workers, "RECALIBRATE_AFTER_S", 0.05)
    url, state = standin
    state.workers = [URLS["b"], URLS["a"]]  # the gateway's own order: index 0 is b
    app = _gateway_app(url, target_workers=True)
    with serve_in_thread(app, lifespan="on", start_timeout_s=10) as proxy:
        workers = app.state.proxy.routing.workers
        assert _wait_for(lambda: workers.state != "pending")
        assert workers.stats()["workers"] == {"b": 0, "a": 1}
        # A worker restarted and rejoined the gateway's list at another place: a targeted
        # call lands on the other replica and targeting turns off.
        state.workers = [URLS["a"], URLS["b"]]
        sent = len(state.received)
        raw = _call(proxy, "c0")
        planned = raw.headers["x-contextpilot-replica"]
        assert raw.headers["x-smg-routed-worker-id"] != URLS[planned]
        assert workers.stats()["misrouted"] == 1
        # After the back-off: two one-token calls per index, and targeting is on again.
        assert _wait_for(lambda: workers.state == "on")
        assert workers.stats()["workers"] == {"a": 0, "b": 1}
        assert workers.stats()["recalibrations"] == 1
        assert len(state.received) - sent == 1 + 2 * len(URLS)  # the call, the calibration
        raws = [_call(proxy, f"c{n}") for n in range(1, 3)]
        assert all(r.headers["x-smg-routed-worker-id"] == URLS[r.headers["x-contextpilot-replica"]]
                   for r in raws)  # fmt: skip
        assert workers.state == "on" and workers.stats()["misrouted"] == 1


def test_a_recalibration_that_fails_is_tried_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_workers, "RECALIBRATE_AFTER_S", 0.01)
    workers = GatewayWorkers(SPECS, enabled=True)
    answers = [[URLS["a"], URLS["b"]]]

    async def probe(index: int) -> str | None:
        if not answers:
            raise OSError("refused")  # the gateway is restarting
        return answers[0][index]

    async def run() -> None:
        await workers.calibrate(probe)
        recalibrating = asyncio.create_task(workers.recalibrate(probe))
        await asyncio.sleep(0.05)
        assert workers.recalibrations == 0  # on: nothing to do
        answers.clear()
        workers.check("a", True, {ROUTED_WORKER_HEADER: URLS["b"]})
        while workers.recalibrations < 2:
            await asyncio.sleep(0.01)
        assert workers.state == "off" and "did not answer" in workers.stats()["reason"]
        answers.append([URLS["b"], URLS["a"]])
        while workers.state != "on":
            await asyncio.sleep(0.01)
        recalibrating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recalibrating

    asyncio.run(asyncio.wait_for(run(), 10))
    assert workers.stats()["workers"] == {"b": 0, "a": 1} and workers.recalibrations >= 3
