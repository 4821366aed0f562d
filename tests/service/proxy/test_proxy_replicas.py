"""The replica router hosted in the proxy, in front of two stand-in upstreams (direct mode) or a
stand-in gateway: conversations stick, a call goes where its documents' prefix is, new work
spreads, a dead replica is routed around, tenants keep their own indexes, and a bad fleet is
refused naming the field (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from proxy_testing import closed_port_url, closed_port_urls, serve_proxy
from service_testing import wait_for
from support.asgi_server import serve_in_thread
from upstream_standin import StandIn, standin_app

from contextpilot_integrations.service.proxy.fleet_config import FleetConfig
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.server import build_parser, config_from_args
from contextpilot_integrations.service.tenants import TenantKeys

SYSTEM = "You answer from the documents."


def _doc(name: str) -> str:
    return " ".join(
        f"{name} sentence {i} says the cache keeps key and value tensors." for i in range(8)
    )


D1, D2, D3, D4, D5, D6, E1, E2, E3 = (
    _doc(n)
    for n in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "fox", "golf", "hotel")
)
# A call following another one on the same replica carries more documents than it: then the
# earlier call's load never makes its replica ineligible for it (the bounded-imbalance rule).


@pytest.fixture
def two_standins() -> Iterator[tuple[list[str], list[StandIn]]]:
    """Two running stand-ins: ``([base URL, ...], [state, ...])``."""
    states = [StandIn(), StandIn()]
    with serve_in_thread(standin_app(states[0])) as a, serve_in_thread(standin_app(states[1])) as b:
        try:
            yield [a, b], states
        finally:
            for state in states:
                state.release.set()


def _direct(urls: list[str], **more: Any) -> dict[str, Any]:
    names = ["a", "b", "c"]
    return {
        "fleet": {
            "mode": "direct",
            "replicas": [{"name": n, "base_url": f"{u}/v1"} for n, u in zip(names, urls)],
            **more,
        }
    }


def _client(proxy: str, session: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{proxy}/v1",
        api_key=key,
        max_retries=0,
        timeout=20,
        default_headers={"x-contextpilot-session": session},
    )


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], documents: Any = None) -> Any:
    extra = {"contextpilot": {"documents": documents}} if documents is not None else None
    return client.chat.completions.with_raw_response.create(
        model="plain",
        messages=messages,  # type: ignore[arg-type]
        extra_body=extra,
    )


def _where(states: list[StandIn], rid: str) -> list[int]:
    """The stand-ins that received the call ``rid``."""
    return [
        i
        for i, state in enumerate(states)
        for body in state.bodies("/v1/chat/completions")
        if body.get("rid") == rid
    ]


def test_conversations_stick_to_their_replica_and_new_ones_spread(two_standins) -> None:  # type: ignore[no-untyped-def]
    urls, states = two_standins
    with serve_proxy(None, _direct(urls)) as proxy:
        replicas: dict[str, set[str]] = {}
        histories = {
            f"conversation-{n}": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question {n}: what does the cache keep?"},
            ]
            for n in range(4)
        }
        for _turn in range(3):
            for session, messages in histories.items():
                raw = _ask(_client(proxy, session), messages)
                rid = raw.headers["x-contextpilot-rid"]
                name = raw.headers["x-contextpilot-replica"]
                # The header names the replica that received the call.
                assert _where(states, rid) == [["a", "b"].index(name)]
                replicas.setdefault(session, set()).add(name)
                messages.append(
                    {"role": "assistant", "content": raw.parse().choices[0].message.content}
                )
                messages.append({"role": "user", "content": "And then?"})
        assert all(len(names) == 1 for names in replicas.values()), replicas
        assert {name for names in replicas.values() for name in names} == {"a", "b"}
        metrics = httpx.get(f"{proxy}/metrics").text
        assert 'contextpilot_proxy_replica_routed_total{replica="a"} 6.0' in metrics
        assert 'contextpilot_proxy_replica_routed_total{replica="b"} 6.0' in metrics


def test_a_call_goes_where_its_documents_prefix_is(two_standins) -> None:  # type: ignore[no-untyped-def]
    urls, states = two_standins
    with serve_proxy(None, _direct(urls)) as proxy:
        opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]
        first = _ask(_client(proxy, "one"), opening, [D1, D2, D3, D4])
        home = first.headers["x-contextpilot-replica"]
        # More work where the prefix is: a call without one goes to the other replica.
        other = _ask(_client(proxy, "two"), opening, [E1, E2, E3])
        assert other.headers["x-contextpilot-replica"] != home
        # A call sharing the prefix goes where it is cached, and finds it there.
        shared = _ask(_client(proxy, "three"), opening, [D2, D1, D3, D5, D6])
        assert shared.headers["x-contextpilot-replica"] == home
        assert int(shared.headers["x-contextpilot-documents-prefix-tokens"]) > 0
        rid = shared.headers["x-contextpilot-rid"]
        assert _where(states, rid) == [["a", "b"].index(home)]


def test_a_dead_replica_is_routed_around(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    dead = closed_port_url()
    with serve_proxy(None, _direct([dead, url], retry_down_s=60)) as proxy:
        began = time.monotonic()
        for n in range(3):
            raw = _ask(
                _client(proxy, f"conversation-{n}"),
                [{"role": "user", "content": f"Question {n}"}],
                [D1, D2],
            )
            assert raw.headers["x-contextpilot-replica"] == "b"
        models = httpx.get(f"{proxy}/v1/models", headers={"authorization": "Bearer x"})
        assert models.status_code == 200 and models.json()["data"]
        assert time.monotonic() - began < 10
        assert len(state.bodies("/v1/chat/completions")) == 3
        metrics = httpx.get(f"{proxy}/metrics").text
        # Refused once, then left out: later calls do not try it.
        assert 'contextpilot_proxy_replica_unreachable_total{replica="a"} 1.0' in metrics
        health = httpx.get(f"{proxy}/health")  # one replica up: still in rotation
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        assert (health.json()["replicas"], health.json()["replicas_up"]) == (2, 1)


def test_with_every_replica_dead_the_call_fails_at_once_naming_the_upstream() -> None:
    with serve_proxy(None, _direct(closed_port_urls(2))) as proxy:
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            _ask(_client(proxy, "s"), [{"role": "user", "content": "Hello"}])
        assert caught.value.status_code == 502
        assert "cannot be reached" in caught.value.message
        assert time.monotonic() - began < 10


def test_health_says_when_every_replica_is_down() -> None:
    fleet = _direct(closed_port_urls(2), retry_down_s=0.5)
    with serve_proxy(None, fleet) as proxy:
        assert httpx.get(f"{proxy}/health").json()["replicas_up"] == 2
        with pytest.raises(openai.InternalServerError):
            _ask(_client(proxy, "s"), [{"role": "user", "content": "Hello"}])
        health = httpx.get(f"{proxy}/health")
        # A load balancer takes the proxy out of rotation ...
        assert health.status_code == 503
        assert health.json()["status"] == "replicas_down"
        assert (health.json()["replicas"], health.json()["replicas_up"]) == (2, 0)
        time.sleep(0.6)
        # ... and, once retry_down_s has passed, still finds them down: their own /health
        # does not answer.
        assert httpx.get(f"{proxy}/health").status_code == 503


def test_health_asks_the_replicas_without_kv_events_before_any_call_is_refused(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    down = closed_port_url()
    with serve_proxy(None, _direct([url, down])) as proxy:
        # No call yet: the first /health starts the probes and reports what it knows.
        assert httpx.get(f"{proxy}/health").json()["replicas_up"] == 2
        wait_for(
            lambda: httpx.get(f"{proxy}/health").json()["replicas_up"] == 1,
            what="the replica that does not answer its /health counted down",
        )
        assert httpx.get(f"{proxy}/health").status_code == 200
        assert state.bodies("/v1/chat/completions") == []  # a GET /health, no call
    with serve_proxy(None, _direct(closed_port_urls(2))) as proxy:
        httpx.get(f"{proxy}/health")
        wait_for(
            lambda: httpx.get(f"{proxy}/health").status_code == 503,
            what="a fleet whose replicas do not answer /health reported down",
        )


def test_behind_a_gateway_calls_carry_the_routing_key(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    fleet = {"mode": "gateway", "replicas": [{"name": "a"}, {"name": "b"}], "key_prefix": "k-"}
    with serve_proxy(url, {"fleet": fleet}) as proxy:
        for n in range(2):
            raw = _ask(_client(proxy, f"c{n}"), [{"role": "user", "content": f"Q{n}"}])
            assert raw.headers["x-contextpilot-replica"] in ("a", "b")
        keys = [r.headers.get("x-contextpilot-route") for r in state.received]
        # One probe key per replica: the second new conversation goes to the other one.
        assert sorted(keys) == ["k-0", "k-1"], keys


def test_tenants_keep_their_own_replica_indexes(two_standins) -> None:  # type: ignore[no-untyped-def]
    urls, _ = two_standins
    tenants = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]
    with serve_proxy(None, _direct(urls), tenants=tenants) as proxy:
        _ask(_client(proxy, "one", "alice-key"), opening, [D1, D2, D3])
        again = _ask(_client(proxy, "two", "alice-key"), opening, [D2, D1, D4, D5])
        bob = _ask(_client(proxy, "one", "bob-key"), opening, [D2, D1, D4, D5])
        assert int(again.headers["x-contextpilot-documents-prefix-tokens"]) > 0
        assert bob.headers["x-contextpilot-documents-prefix-tokens"] == "0"
        usage = httpx.get(f"{proxy}/v1/usage", headers={"authorization": "Bearer bob-key"}).json()
        assert usage["tenant"] == "bob" and usage["plans"] == 1
        # /v1/stats shows each tenant its own replica router, never the other's.
        seen = {
            name: httpx.get(
                f"{proxy}/v1/stats", headers={"authorization": f"Bearer {name}-key"}
            ).json()["proxy"]
            for name in ("alice", "bob")
        }
        indexed = {
            name: sum(r["index"]["requests"] for r in got["replicas"]["replicas"].values())
            for name, got in seen.items()
        }
        assert indexed == {"alice": 2, "bob": 1} and seen["alice"]["window"] is None, seen


@pytest.mark.parametrize(
    ("fleet", "upstream", "message"),
    [
        ({"mode": "direct", "replicas": [{"name": "a"}]}, None, "fleet.replicas[0].base_url"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "ftp://x"}]}, None,
         "fleet.replicas[0].base_url must be an http(s) URL"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x"}]},
         "http://gateway", "upstream_url and a direct fleet exclude each other"),
        ({"mode": "gateway", "replicas": [{"name": "a"}]}, None, "upstream_url is needed"),
        ({"mode": "direct", "replicas": []}, None, "at least one replica"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x"}] * 2}, None,
         "replica names must be unique"),
        ({"mode": "direct", "replicas": ["http://x"]}, None, "fleet.replicas[0] must be a mapping"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x"}],
          "retry_down_s": 0}, None, "fleet.retry_down_s"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x"}],
          "max_imbalance": 0.5}, None, "max_imbalance"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x"}], "rule": 1},
         None, "fleet: unknown setting(s) ['rule']; known: ['in_flight_timeout_s', "),
        ({"mode": "direct", "replicas": [
            {"name": "a", "base_url": "http://x", "cache_sync": {"kind": "kv-events"}}]},
         None, "fleet.replicas[0].cache_sync"),
        ({"mode": "direct", "replicas": [
            {"name": n, "base_url": f"http://{n}",
             "cache_sync": {"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5557"}}
            for n in ("a", "b")]}, None, "fleet.replicas[1].cache_sync.endpoint"),
        ({"mode": "direct", "replicas": [
            {"name": "a", "base_url": "http://x:8000/v1"},
            {"name": "b", "base_url": "HTTP://X:8000/"}]}, None,
         "fleet.replicas[1].base_url 'HTTP://X:8000/' is also replica 'a''s"),
        ({"mode": "direct", "replicas": [
            {"name": "a", "base_url": "http://127.0.0.1:8000/v1"},
            {"name": "b", "base_url": "http://[::ffff:127.0.0.1]:8000"}]}, None,
         "fleet.replicas[1].base_url 'http://[::ffff:127.0.0.1]:8000' is also replica 'a''s"),
        ({"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x/x/../v1"}]}, None,
         "fleet.replicas[0].base_url 'http://x/x/../v1': the path '/x/../v1' has"),
        ({"mode": "direct", "replicas": [
            {"name": "a", "base_url": "https://x:443/v1"},
            {"name": "b", "base_url": "https://X"}]}, None,
         "fleet.replicas[1].base_url 'https://X' is also replica 'a''s ('https://x:443/v1')"),
        ({"mode": "direct", "replicas": [
            {"name": "a", "base_url": "http://x:80"}, {"name": "b", "base_url": "http://x:8000"}]},
         None, None),
        ({"mode": "gateway", "replicas": [
            {"name": "a", "base_url": "http://x"}, {"name": "b", "base_url": "http://x"}]},
         "http://gateway", "fleet.replicas[1].base_url 'http://x' is also replica 'a''s"),
    ],
)  # fmt: skip
def test_a_bad_fleet_is_refused_naming_the_field(
    fleet: dict[str, Any], upstream: str | None, message: str | None
) -> None:
    if message is None:  # two endpoints: accepted
        ProxyConfig(upstream, fleet=fleet)  # type: ignore[arg-type]
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        ProxyConfig(upstream, fleet=fleet)  # type: ignore[arg-type]


def test_the_fleet_mapping_takes_the_routers_rule() -> None:
    fleet = FleetConfig.from_mapping(
        {"mode": "direct", "replicas": [{"name": "a", "base_url": "http://x"}]}
    )
    assert fleet.load == "recent-tokens" and fleet.direct
    in_flight = FleetConfig.from_mapping(
        {"mode": "gateway", "replicas": [{"name": "a"}], "load": "in-flight-tokens"}
    )
    assert in_flight.load == "in-flight-tokens" and not in_flight.direct
    # A replica's KV capacity survives the copy of its cache_sync (its index's budget).
    capped = FleetConfig.from_mapping(
        {"mode": "gateway", "replicas": [{"name": "a", "kv_capacity_tokens": 2432,
                                          "cache_sync": {"kind": "capacity",
                                                         "capacity_tokens": 2432}}]}
    )  # fmt: skip
    assert capped.router.replicas[0].kv_capacity_tokens == 2432
    with pytest.raises(ValueError, match=r"fleet.replicas\[0\].kv_capacity_tokens must be"):
        FleetConfig.from_mapping({"replicas": [{"name": "a", "kv_capacity_tokens": "big"}]})


def _config(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(argv), {})


def test_the_fleet_from_the_command_line(tmp_path: Path) -> None:
    direct = _config(
        ["--replica", "http://127.0.0.1:8001/v1", "--replica", "http://127.0.0.1:8002/v1",
         "--replica-kv-events", "tcp://127.0.0.1:5557",
         "--replica-kv-events", "tcp://127.0.0.1:5559", "--kv-events-topic", "kv-events"]
    ).proxy  # fmt: skip
    assert direct is not None and direct.upstream_url is None and direct.fleet is not None
    assert direct.fleet.direct
    [a, b] = direct.fleet.router.replicas
    assert (a.name, a.base_url) == ("replica-0", "http://127.0.0.1:8001/v1")
    assert b.cache_sync == {"kind": "kv-events", "endpoint": "tcp://127.0.0.1:5559",
                            "topic": "kv-events"}  # fmt: skip
    gateway = _config(["--upstream", "http://127.0.0.1:30000", "--replica", "http://r:1"]).proxy
    assert gateway is not None and gateway.fleet is not None and not gateway.fleet.direct
    assert not gateway.fleet.target_workers  # the routing key alone unless asked
    targeted = _config(["--upstream", "http://g:1", "--replica", "http://r:1", "--target-workers"])
    assert targeted.proxy.fleet.target_workers
    assert gateway.upstream_url == "http://127.0.0.1:30000"
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"replicas": [{"name": "x", "base_url": "http://x:1/v1"}],
                                "max_imbalance": 2}))  # fmt: skip
    from_file = _config(["--replicas-config", str(path)]).proxy
    assert from_file is not None and from_file.fleet is not None
    assert from_file.fleet.direct and from_file.fleet.router.max_imbalance == 2
    # --upstream alone: one upstream, no router, as it always was.
    alone = _config(["--upstream", "http://127.0.0.1:8000/v1"]).proxy
    assert alone is not None and alone.fleet is None


@pytest.mark.parametrize(
    ("key", "value", "flags", "flag"),
    [("max_in_flight", 4, ["--replica-max-in-flight", "2"], "--replica-max-in-flight"),
     ("ordered", True, ["--replica-order", "arrival"], "--replica-order"),
     ("target_workers", False, ["--upstream", "http://g:1", "--target-workers"],
      "--target-workers")],
)  # fmt: skip
def test_a_fleet_file_setting_given_by_its_flag_too_is_refused_naming_both(
    tmp_path: Path, key: str, value: object, flags: list[str], flag: str
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"replicas": [{"name": "x", "base_url": "http://x:1"}],
                                key: value}))  # fmt: skip
    with pytest.raises(ValueError) as caught:
        _config(["--replicas-config", str(path), *flags])
    assert f"gives {key} and {flag} is given too" in str(caught.value)
    path.write_text(json.dumps({"replicas": [{"name": "x", "base_url": "http://x:1"}]}))
    assert _config(["--replicas-config", str(path), *flags]).proxy is not None  # one place: read


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--replica-kv-events", "tcp://h:1"], "--replica-kv-events: 1 given for 0 --replica"),
        (["--replica", "http://a", "--replica-kv-events", "tcp://h:1", "--replica-kv-events",
          "tcp://h:2"], "2 given for 1 --replica"),
        (["--replica", "ftp://a"], "--replica: fleet.replicas[0].base_url must be an http(s)"),
        (["--replica", "http://a", "--replicas-config", "f.json"], "not both"),
        (["--replicas-config", "/nonexistent/fleet.json"], "--replicas-config"),
        (["--replica-order", "arrival"], "--replica-order needs replicas"),
        (["--target-workers"], "--target-workers needs replicas"),
        (["--replica", "http://a", "--target-workers"], "target_workers needs the gateway mode"),
    ],
)  # fmt: skip
def test_inconsistent_replica_options_are_refused(argv: list[str], words: str) -> None:
    with pytest.raises(ValueError) as caught:
        _config(argv)
    assert words in str(caught.value)


def test_each_replicas_one_link_gives_each_tenant_its_own_evictions(tmp_path: Path) -> None:
    """One engine link per replica, shared by the tenants' routers, over the real ZMQ
    protocol publisher: an eviction reaches the router of the rid's tenant only."""
    from prometheus_client import CollectorRegistry

    from contextpilot_integrations.service.proxy.replica_routing import ReplicaRouting
    from contextpilot_integrations.service.tenants import Tenancy
    from contextpilot_integrations.sync.event_publisher import KVEventPublisher
    from contextpilot_integrations.sync.kv_events import BlockRemoved, BlockStored, KVEventBatch

    def endpoints(name: str) -> tuple[str, str]:
        return f"ipc://{tmp_path}/{name}-events.ipc", f"ipc://{tmp_path}/{name}-replay.ipc"

    def stored(hashes: list[int], rid: str) -> KVEventBatch:
        tokens = [t for h in hashes for t in (h, h)]
        event = BlockStored(hashes, None, tokens, block_size=2, session_id=rid)
        return KVEventBatch(ts=time.time(), events=[event])

    replicas = [
        {"name": n, "base_url": f"http://{n}/v1",
         "cache_sync": {"kind": "kv-events", "endpoint": endpoints(n)[0],
                        "replay_endpoint": endpoints(n)[1]}}
        for n in ("a", "b")
    ]  # fmt: skip
    tenancy = Tenancy({"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))})
    config = ProxyConfig(None, fleet={"mode": "direct", "replicas": replicas})  # type: ignore[arg-type]
    with KVEventPublisher(*endpoints("a")) as engine_a, KVEventPublisher(*endpoints("b")):
        routing = ReplicaRouting(config, tenancy, CollectorRegistry())
        routing.start()
        try:
            alice, bob = routing.router_of("alice"), routing.router_of("bob")
            assert alice is not bob
            alice_rid = f"{tenancy.rid_tag('alice')}.r1"
            bob_rid = f"{tenancy.rid_tag('bob')}.r1"
            on_a = alice.plan("q", [D1, D2], rid=alice_rid)
            assert on_a.replica == "a" and on_a.cache_salt == tenancy.cache_salt("alice")
            assert bob.plan("q", [D1, D2], rid=bob_rid).replica == "a"  # its own index: no prefix
            engine_a.publish(stored([1, 2], alice_rid))
            engine_a.publish(stored([5, 6], bob_rid))
            deadline = time.monotonic() + 10
            while (
                alice.replica_of(alice_rid) != "a"
                or routing.stats()["alice"]["replicas"]["a"]["sync"]["source"]["mirror"]["blocks"]
                < 4
            ):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            engine_a.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([2])]))
            while alice.stats()["replicas"]["a"]["index"]["requests"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert bob.stats()["replicas"]["a"]["index"]["requests"] == 1
            # Bob's eviction reaches bob's router (not the first tenant's).
            engine_a.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([6])]))
            while bob.stats()["replicas"]["a"]["index"]["requests"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            routing.stop()


def _burst(proxy: str, documents: list[list[str]]) -> list[Any]:
    """One warm-up call (so the window's arrival rate expects company), then one call per
    entry of ``documents``, all at once, each in a conversation of its own."""
    from concurrent.futures import ThreadPoolExecutor

    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]
    _ask(_client(proxy, "warm-up"), opening, [_doc("warm")])
    with ThreadPoolExecutor(len(documents)) as pool:
        futures = [
            pool.submit(_ask, _client(proxy, f"burst-{n}"), opening, docs)
            for n, docs in enumerate(documents)
        ]
        return [future.result() for future in futures]


# D1 and D2 are shared, but never first: planned one at a time, each call keeps its own
# first document (nothing of it is cached yet); planned jointly, the shared pair goes first.
_SHARED = [[D3, D1, D2], [D4, D2, D1], [D5, D1, D2]]
_APART = [[E1, E2, D6], [E2, E1, E3], [E3, E1, E2]]


def _documents_order(state: StandIn, rid: str) -> list[str]:
    """The documents ``rid`` was sent with, in the order shown (by each one's first words)."""
    [body] = [b for b in state.bodies("/v1/chat/completions") if b.get("rid") == rid]
    content = body["messages"][-1]["content"]
    shown = [(content.find(d), d) for d in (D1, D2, D3, D4, D5, D6, E1, E2, E3) if d in content]
    return [d for _, d in sorted(shown)]


def _windowed_app(urls: list[str], **fleet: Any) -> Any:
    """The proxy's app over the direct fleet ``urls`` with a 1.5 s planning window."""
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.service_config import ServiceConfig

    proxy = ProxyConfig(None, **_direct(urls, **fleet))  # type: ignore[arg-type]
    return create_app(ServiceConfig(proxy=proxy, window_ms=1500))


def test_calls_arriving_together_are_planned_as_one_batch_across_the_fleet(two_standins) -> None:  # type: ignore[no-untyped-def]
    urls, states = two_standins
    app = _windowed_app(urls)
    with serve_in_thread(app, lifespan="on") as proxy:
        answers = _burst(proxy, _SHARED + _APART)
        window = app.state.proxy.routing.stats()[""]["window"]
    assert window["requests"] == 7 and window["windows"] == 2, window  # warm-up, then the burst
    where = [a.headers["x-contextpilot-replica"] for a in answers]
    # Each group on one replica, the two groups on the two replicas (balanced as a whole).
    assert len(set(where[:3])) == 1 and len(set(where[3:])) == 1 and where[0] != where[3], where
    orders = [
        _documents_order(states[["a", "b"].index(name)], a.headers["x-contextpilot-rid"])
        for a, name in zip(answers, where)
    ]
    heads = {tuple(order[:2]) for order in orders[:3]}
    assert len(heads) == 1 and set(next(iter(heads))) == {D1, D2}, orders


def test_without_a_fleet_the_services_window_plans_document_calls_jointly(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, window_ms=1500) as proxy:
        answers = _burst(proxy, _SHARED)
        window = httpx.get(f"{proxy}/v1/stats").json()["service"]["window"]
    assert window["requests"] == 4 and window["windows"] == 2, window
    orders = [_documents_order(state, a.headers["x-contextpilot-rid"]) for a in answers]
    heads = {tuple(order[:2]) for order in orders}
    assert len(heads) == 1 and set(next(iter(heads))) == {D1, D2}, orders


def test_a_call_whose_client_left_while_it_waited_in_the_window_is_undone(standin) -> None:  # type: ignore[no-untyped-def]
    import anyio

    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.service_config import ServiceConfig

    url, state = standin
    app = create_app(ServiceConfig(proxy=ProxyConfig(url), window_ms=2000))
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]

    def body(documents: list[str]) -> dict[str, Any]:
        return {"model": "plain", "messages": opening, "contextpilot": {"documents": documents}}

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                answer = await client.post("/v1/chat/completions", json=body([D1, D2]))
                assert answer.status_code == 200
                # Right after another call: the window waits for company, and the client
                # leaves first.
                with anyio.move_on_after(0.3) as scope:
                    await client.post("/v1/chat/completions", json=body([D3, D4]))
                assert scope.cancelled_caught
                index = app.state.service.pilot_of(None).index
                deadline = time.monotonic() + 10
                # Planned once its window closed, then undone: evicted, never forwarded.
                while index.stats().inserts != 2 or index.stats().requests != 1:
                    assert time.monotonic() < deadline, index.stats()
                    await anyio.sleep(0.05)
                await anyio.sleep(0.5)
                assert index.stats().requests == 1 and len(state.received) == 1

    anyio.run(scenario)


def _streamed_burst(proxy: str, documents: list[list[str]]) -> list[tuple[str, str]]:
    """:func:`_burst` with streamed ``"slow-start"`` answers: each call's ``(replica, rid)``."""
    from concurrent.futures import ThreadPoolExecutor

    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]

    def ask(session: str, docs: list[str]) -> tuple[str, str]:
        with httpx.stream(
            "POST",
            f"{proxy}/v1/chat/completions",
            json={
                "model": "slow-start",
                "stream": True,
                "messages": opening,
                "contextpilot": {"documents": docs},
            },
            headers={"x-contextpilot-session": session},
            timeout=30,
        ) as answer:
            assert answer.status_code == 200
            answer.read()
            return answer.headers["x-contextpilot-replica"], answer.headers["x-contextpilot-rid"]

    ask("warm-up", [_doc("warm")])
    with ThreadPoolExecutor(len(documents)) as pool:
        futures = [pool.submit(ask, f"burst-{n}", docs) for n, docs in enumerate(documents)]
        return [future.result() for future in futures]


def _per_replica(
    states: list[StandIn], calls: list[tuple[str, str]]
) -> dict[str, list[list[float]]]:
    """Each replica's burst calls' ``[came, first event, last event]``, in the order they came."""
    out: dict[str, list[list[float]]] = {}
    for name, rid in calls:
        out.setdefault(name, []).append(states[["a", "b"].index(name)].timeline[rid])
    return {name: sorted(times) for name, times in out.items()}


def test_a_windows_calls_reach_each_replica_one_after_the_others_first_token(two_standins) -> None:  # type: ignore[no-untyped-def]
    urls, states = two_standins
    app = _windowed_app(urls, ordered=True)
    with serve_in_thread(app, lifespan="on") as proxy:
        calls = _streamed_burst(proxy, _SHARED + _APART)
        door = app.state.proxy.routing.order
        deadline = time.monotonic() + 10
        # Every call finishes at the door (a client may have its answer a moment before).
        while any(door.stats()["in_flight"].values()):
            assert time.monotonic() < deadline, door.stats()
            time.sleep(0.01)
        order = door.stats()
    timelines = _per_replica(states, calls)
    assert sorted(len(t) for t in timelines.values()) == [3, 3], timelines
    for name, times in timelines.items():
        # Each call came once the one before it on its replica had started its answer (so
        # its prefix was in the cache), never beside it.
        for before, after in zip(times, times[1:]):
            assert after[0] >= before[1], (name, times)
    assert order["issued"] >= 6 and order["stale"] == 0, order


def test_at_most_max_in_flight_calls_are_out_at_once_per_replica(two_standins) -> None:  # type: ignore[no-untyped-def]
    urls, states = two_standins
    app = _windowed_app(urls, ordered=False, max_in_flight=1)
    with serve_in_thread(app, lifespan="on") as proxy:
        calls = _streamed_burst(proxy, _SHARED + _APART)
    for name, times in _per_replica(states, calls).items():
        for before, after in zip(times, times[1:]):
            assert after[0] >= before[2], (name, times)


def test_a_window_is_held_while_the_replica_has_calls_waiting_at_its_door(standin) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.service_config import ServiceConfig

    url, state = standin
    fleet = _direct([url], max_in_flight=1, window_hold_ms=30_000)
    app = create_app(ServiceConfig(proxy=ProxyConfig(None, **fleet), window_ms=50))
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]

    def ask(model: str, documents: list[str]) -> int:
        body = {"model": model, "messages": opening, "contextpilot": {"documents": documents}}
        session = {"x-contextpilot-session": documents[0][:12]}  # a conversation each
        return httpx.post(
            f"{proxy}/v1/chat/completions", json=body, headers=session, timeout=30
        ).status_code

    with serve_in_thread(app, lifespan="on") as proxy, ThreadPoolExecutor(5) as pool:
        routing = app.state.proxy.routing
        window = lambda: httpx.get(f"{proxy}/v1/stats").json()["proxy"]["window"]  # noqa: E731
        stalled = pool.submit(ask, "stall", [E1])  # holds the replica's one place
        wait_for(lambda: routing.order.stats()["in_flight"].get("a") == 1)
        waiting = pool.submit(ask, "plain", [E2])  # planned alone, then waits at the door
        wait_for(lambda: routing.order.backlogged(["a"]))
        # Three calls sharing documents come apart, each long after the window's 50 ms: the
        # replica is busy, so they are held in one window and planned together.
        later = []
        for docs in _SHARED:
            later.append(pool.submit(ask, "plain", docs))
            time.sleep(0.2)
        assert window()["requests"] == 2 and not any(f.done() for f in later), window()
        state.release.set()  # the first answer ends: the waiting call goes, the window closes
        assert [f.result() for f in (stalled, waiting, *later)] == [200] * 5
        stats = window()
    assert (stats["windows"], stats["requests"], stats["held"]) == (3, 5, 1), stats
    assert stats["held_ms"] >= 500, stats
    orders = [
        _documents_order(state, body["rid"])
        for body in state.bodies("/v1/chat/completions")
        if any(
            D3 in m.get("content", "") or D4 in m.get("content", "") or D5 in m.get("content", "")
            for m in body["messages"]
        )
    ]
    heads = {tuple(order[:2]) for order in orders}
    assert len(orders) == 3 and len(heads) == 1 and set(next(iter(heads))) == {D1, D2}, orders


@pytest.mark.parametrize(
    ("fleet", "words"),
    [
        ({"max_in_flight": 0}, "fleet.max_in_flight must be an int >= 1 or null, got 0"),
        ({"ordered": "yes"}, "fleet.ordered must be true or false, got 'yes'"),
        (
            {"window_hold_ms": -5},
            "fleet.window_hold_ms must be a number of milliseconds in [0, 60000], got -5",
        ),
        (
            {"window_hold_ms": 100},
            "fleet.window_hold_ms 100 holds a window while calls wait "
            "at the replicas' door, and without fleet.ordered or fleet.max_in_flight none ever "
            "waits",
        ),
    ],
)
def test_a_bad_door_setting_is_refused_naming_the_field(fleet: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        FleetConfig.from_mapping(
            {"mode": "direct", "replicas": [{"name": "a", "base_url": "http://a/v1"}], **fleet}
        )


def test_the_replicas_door_from_the_command_line() -> None:
    default = _config(["--replica", "http://a:1"]).proxy.fleet
    # Off by default: ordered calls that are not streamed would go one at a time per replica.
    assert not default.ordered and default.max_in_flight is None
    argv = [
        "--replica",
        "http://a:1",
        "--replica-order",
        "schedule",
        "--replica-max-in-flight",
        "9",
    ]
    fleet = _config(argv).proxy.fleet
    assert fleet.ordered and fleet.max_in_flight == 9
    assert default.window_hold_ms == 0
    held = _config([*argv, "--window-ms", "20", "--window-hold-ms", "5000"]).proxy.fleet
    assert held.window_hold_ms == 5000
    with pytest.raises(ValueError, match=r"--window-hold-ms 5000 holds planning windows: give "):
        _config([*argv, "--window-hold-ms", "5000"])  # no window to hold
    no_door = ["--replica", "http://a:1", "--window-ms", "20", "--window-hold-ms", "5000"]
    with pytest.raises(ValueError, match=r"give --replica-order schedule or --replica-max-in"):
        _config(no_door)
    with pytest.raises(ValueError, match=r"--window-hold-ms needs replicas"):
        _config(["--upstream", "http://a:1", "--window-hold-ms", "5000"])


def test_a_call_the_engine_refuses_leaves_its_replicas_index_and_load(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]

    def ask(proxy: str, model: str, documents: list[str]) -> int:
        body = {"model": model, "messages": opening, "contextpilot": {"documents": documents}}
        session = {"x-contextpilot-session": model + str(len(documents))}
        return httpx.post(
            f"{proxy}/v1/chat/completions", json=body, headers=session, timeout=30
        ).status_code

    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.service_config import ServiceConfig

    app = create_app(ServiceConfig(proxy=ProxyConfig(None, **_direct([url]))))
    with serve_in_thread(app, lifespan="on") as proxy:
        routing = app.state.proxy.routing
        stats = lambda: routing.router_of(None).stats()["replicas"]["a"]  # noqa: E731
        assert ask(proxy, "plain", [D1, D2]) == 200
        wait_for(lambda: stats()["index"]["requests"] == 1)
        load = stats()["load"]
        # Refused (a prompt too long, an unknown model): nothing was prefilled, so nothing of
        # it may count as cached or as the replica's load.
        assert ask(proxy, "error-400", [D3, D4, E1, E2, E3]) == 400
        wait_for(lambda: stats()["index"]["requests"] == 1)
        assert stats()["load"] == load
        # A server error may come after the prefill: the index keeps it (events correct it).
        assert ask(proxy, "error-500", [D5, D6]) == 500
        wait_for(lambda: stats()["index"]["requests"] == 2)
        assert stats()["load"] > load


def test_the_door_stops_holding_behind_a_stuck_call_within_the_upstreams_timeout() -> None:
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.service_config import ServiceConfig

    def door(timeout: float | None) -> Any:
        proxy = ProxyConfig(None, read_timeout_s=timeout, **_direct(["http://a:1"]))
        return create_app(ServiceConfig(proxy=proxy)).state.proxy.routing.order

    # A call ends at the read timeout: a door bound past it would never be reached.
    assert door(20.0).stuck_s == 10.0 and door(600.0).stuck_s == 30.0
    assert door(None).stuck_s == 30.0


def test_a_fleet_file_giving_a_key_twice_is_refused_naming_it(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(
        '{"mode": "direct", "replicas": [{"name": "a", "base_url": "http://a:1/v1"}], '
        '"ordered": true, "window_hold_ms": 1000, "window_hold_ms": 2000}'
    )
    with pytest.raises(ValueError, match=r"the key 'window_hold_ms' is given twice"):
        _config(["--replicas-config", str(fleet), "--window-ms", "20"])


def test_the_windows_max_batch_sizes_the_proxys_windows_and_its_threads() -> None:
    from contextpilot_integrations.service.app import create_app
    from contextpilot_integrations.service.service_config import ServiceConfig

    config = _config(["--replica", "http://a:1", "--window-ms", "20", "--window-max-batch", "200"])
    assert config.window_max_batch == 200 and _config([]).window_max_batch == 64
    app = create_app(config)
    window = app.state.proxy.routing.planner_of(None)
    assert window.policy.max_batch == 200
    assert app.state.proxy.prepare_threads()._max_workers == 400  # a full window and the next
    with pytest.raises(ValueError, match=r"window_max_batch must be an int from 1 to 1024, got 0"):
        ServiceConfig(window_max_batch=0)


def test_a_call_whose_client_hung_up_in_the_window_is_never_forwarded(standin) -> None:  # type: ignore[no-untyped-def]
    # A real server does not cancel the call when its client hangs up: the proxy watches.
    url, state = standin
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]

    def body(documents: list[str]) -> dict[str, Any]:
        return {"model": "plain", "messages": opening, "contextpilot": {"documents": documents}}

    with serve_proxy(url, window_ms=2000) as proxy:
        assert httpx.post(f"{proxy}/v1/chat/completions", json=body([D1, D2])).status_code == 200
        # Right after another call: the window waits for company, and the client hangs up.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{proxy}/v1/chat/completions",
                json=body([D3, D4]),
                timeout=httpx.Timeout(10, read=0.3),
            )
        stats = lambda: httpx.get(f"{proxy}/v1/stats").json()  # noqa: E731
        deadline = time.monotonic() + 10
        # Planned once its window closed, then undone: evicted, never forwarded.
        while (index := stats()["index"])["inserts"] != 2 or index["requests"] != 1:
            assert time.monotonic() < deadline, index
            time.sleep(0.05)
        time.sleep(0.5)
        assert stats()["index"]["requests"] == 1 and len(state.received) == 1


def test_a_call_refused_after_its_documents_were_planned_frees_its_replicas_door(  # type: ignore[no-untyped-def]
    two_standins, monkeypatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from contextpilot_integrations.core.messages import MessagePlanner

    urls, states = two_standins
    app = _windowed_app(urls, ordered=True, max_in_flight=1)
    opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What?"}]

    def ask(documents: list[str], session: str = "warm-up") -> int:
        body = {"model": "plain", "messages": opening, "contextpilot": {"documents": documents}}
        headers = {"x-contextpilot-session": session}
        answer = httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=headers, timeout=30)
        return answer.status_code

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("messages[1] is refused by the planner (injected)")

    with serve_in_thread(app, lifespan="on") as proxy:
        assert ask([_doc("warm")]) == 200
        routing = app.state.proxy.routing
        with monkeypatch.context() as patch, ThreadPoolExecutor(3) as pool:
            patch.setattr(MessagePlanner, "plan", refuse)
            # Planned together in one window: each gets its ticket, then is refused.
            refused = pool.map(ask, _SHARED, ["b-0", "b-1", "b-2"])
            assert list(refused) == [422] * 3
        door = routing.order.stats()
        # Their tickets left the door at once (not after the stale timeout), their rids the
        # index.
        assert door["issued"] == 4 and not any(door["queued"].values()), door
        indexed = sum(r["index"]["requests"] for r in routing.stats()[""]["replicas"].values())
        assert indexed == 1
        assert ask([D1, D2]) == 200
        assert routing.order.stats()["stale"] == 0
