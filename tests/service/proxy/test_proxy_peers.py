"""Two proxy processes that plan as one, in front of the stand-in upstream: a conversation whose
calls reach either is planned by its owner (replay and pointers as with one process); the hop
keeps streaming, cancellation, errors in the client's API shape and the tenant's key; a mark
that is not the peers' is ignored; a peer that is down leaves its calls to the one they reached
(docs/DESIGN.md, "Proxy peers")."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from proxy_testing import (
    agent_loop,
    assert_replayed,
    bound_socket,
    closed_port_url,
    serve_proxy,
)
from service_testing import wait_for
from upstream_standin import SEARCH_RESULT

from contextpilot_integrations.service.proxy.peer_config import PEER_SECRET_ENV, PeerConfig
from contextpilot_integrations.service.proxy.peers import (
    PEER_HEADER,
    PLANNED_BY_HEADER,
    owner_key,
    rendezvous_order,
)
from contextpilot_integrations.service.proxy.proxy_config import ProxyConfig
from contextpilot_integrations.service.server import build_parser, config_from_args
from contextpilot_integrations.service.tenants import TenantKeys

SECRET = "peers-secret-0123456789"
TENANTS = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}


@contextmanager
def two_proxies(upstream: str, **service: Any) -> Iterator[tuple[str, str]]:
    """Two proxies in front of ``upstream`` that name each other as peers."""
    sockets = [bound_socket(), bound_socket()]
    urls = tuple(f"http://127.0.0.1:{s.getsockname()[1]}" for s in sockets)
    with ExitStack() as stack:
        for sock, url in zip(sockets, urls, strict=True):
            peers = PeerConfig(urls, url, SECRET)
            stack.enter_context(serve_proxy(upstream, {"peers": peers}, sock=sock, **service))
        yield urls[0], urls[1]


def _owned_session(tenant: str | None, owner: str, urls: tuple[str, str], stem: str) -> str:
    """A session id whose conversation ``owner`` owns."""
    for i in range(100):
        session = f"{stem}-{i}"
        key = owner_key(b"", "openai", tenant, session)
        assert key is not None
        if rendezvous_order(key, urls)[0] == owner:
            return session
    raise AssertionError("no session of 100 is owned by it")


def _agent_call(
    url: str, messages: list[dict[str, Any]], session: str | None, key: str = "none"
) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="agent",
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-contextpilot-session": session} if session else None,
    )


def _converse(entries: tuple[str, ...], session: str | None, key: str = "none") -> list[Any]:
    """A tool-using conversation, call ``i`` sent to ``entries[i]``; the raw answers."""
    clients = {
        url: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) for url in entries
    }
    return agent_loop([clients[url] for url in entries], session)


def _assert_one_conversation(bodies: list[dict[str, Any]]) -> None:
    """Each call's messages lead the next's; the repeated search result went as a pointer."""
    for earlier, later in zip(bodies, bodies[1:]):
        assert_replayed(earlier["messages"], later["messages"])
    first, second = (m for m in bodies[-1]["messages"] if m["role"] == "tool")
    assert first["content"] == SEARCH_RESULT
    assert second["content"].startswith("[Same result as search(")


def _metric(url: str, line: str) -> bool:
    return line in httpx.get(f"{url}/metrics", headers={"authorization": "Bearer alice-key"}).text


def test_a_conversation_spread_over_two_processes_is_planned_as_one(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    with two_proxies(upstream, tenants=TENANTS) as (a, b):
        # Alice's conversation is owned by b; its calls go to a, b, a (a balancer's spread).
        session = _owned_session("alice", b, (a, b), "talk")
        raws = _converse((a, b, a), session, "alice-key")
        bodies = state.bodies("/v1/chat/completions")
        assert len(bodies) == 3
        _assert_one_conversation(bodies)
        # The owner's report comes back through the hop; one boot id, the entry's own.
        planned_by = {raw.headers[PLANNED_BY_HEADER] for raw in raws}
        assert len(planned_by) == 1
        assert raws[2].headers["x-contextpilot-pointers"] == "1"
        assert raws[2].headers["x-contextpilot-replayed"] != "0"
        for raw in raws:
            assert len(raw.headers.get_list("x-contextpilot-boot")) == 1
        # The tenant came from the client's key at the owner: the salt is alice's; the
        # upstream never sees a client key, a session header or the peers' mark.
        assert len({body["cache_salt"] for body in bodies}) == 1
        for received in state.received:
            assert "alice-key" not in json.dumps(received.headers)
            assert PEER_HEADER not in received.headers
            assert SECRET not in json.dumps(received.headers)
        # The owner holds the conversation's totals; the entry counted the hops.
        usage_b = httpx.get(f"{b}/v1/usage", headers={"authorization": "Bearer alice-key"}).json()
        assert usage_b["conversations"]["alice"][session]["plans"] == 3
        usage_a = httpx.get(f"{a}/v1/usage", headers={"authorization": "Bearer alice-key"}).json()
        assert session not in usage_a.get("conversations", {}).get("alice", {})
        assert _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="forwarded"} 2.0')
        assert _metric(b, 'contextpilot_proxy_peer_calls_total{outcome="from_peer"} 2.0')
        assert _metric(b, 'contextpilot_proxy_peer_calls_total{outcome="owned"} 1.0')
        # A wrong key is refused where it arrives: nothing forwarded.
        with pytest.raises(openai.AuthenticationError):
            _agent_call(a, [{"role": "user", "content": "hi"}], session, "mallory-key")
        assert len(state.received) == 3


def test_a_conversation_without_a_session_id_meets_its_owner_too(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    with two_proxies(upstream) as (a, b):
        raws = _converse((a, b, a, b), None)
        assert len({raw.headers[PLANNED_BY_HEADER] for raw in raws}) == 1
        assert raws[-1].headers["x-contextpilot-conversation-source"] == "opening"
        _assert_one_conversation(state.bodies("/v1/chat/completions"))


def _doc(name: str) -> str:
    return " ".join(
        f"{name} sentence {i} says the cache keeps key and value tensors." for i in range(8)
    )


def _ask(url: str, messages: list[dict[str, Any]], extension: dict[str, Any]) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="plain",
        messages=messages,  # type: ignore[arg-type]
        extra_body={"contextpilot": extension},
    )


def test_documents_meet_their_conversation_and_their_tenant_index(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    d1, d2, d3, d4, d5 = (_doc(n) for n in ("alpha", "bravo", "charlie", "delta", "echo"))
    with two_proxies(upstream) as (a, b):
        # A named conversation: its with-documents message is put back by its owner on the
        # next call, whichever process each call reached.
        session = _owned_session(None, a, (a, b), "rag")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is kept?"}]
        first = _ask(b, messages, {"documents": [d1, d2], "conversation_id": session})
        messages += [{"role": "assistant", "content": "done"},
                     {"role": "user", "content": "And where?"}]  # fmt: skip
        second = _ask(a, messages, {"documents": [d3], "conversation_id": session})
        assert second.headers["x-contextpilot-restored"] == "1"
        sent = state.bodies("/v1/chat/completions")
        assert_replayed(sent[0]["messages"], sent[1]["messages"])
        assert first.headers[PLANNED_BY_HEADER] == second.headers[PLANNED_BY_HEADER]
        # Document calls without a conversation: the tenant's owner plans them all, so its
        # index holds the prefix an earlier call sent, whichever process the call reached.
        planned = []
        for entry, question in ((a, "Why?"), (b, "How?"), (a, "When?"), (b, "Who?")):
            raw = _ask(entry, [{"role": "user", "content": question}], {"documents": [d4, d5]})
            planned.append(raw.headers[PLANNED_BY_HEADER])
            tokens = int(raw.headers["x-contextpilot-documents-prefix-tokens"])
            assert (tokens > 0) == (question != "Why?")
        assert len(set(planned)) == 1


def test_the_hop_streams_cancels_and_keeps_the_error_shape(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    with two_proxies(upstream) as (a, b):
        session = _owned_session(None, b, (a, b), "stream")
        # The first chunk arrives while the upstream still holds the rest.
        client = openai.OpenAI(
            base_url=f"{a}/v1", api_key="none", max_retries=0,
            default_headers={"x-contextpilot-session": session},
        )  # fmt: skip
        stream = client.chat.completions.create(
            model="gated", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.content == "do"
        state.gate.set()
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ne"
        assert state.saw_gate == [True]
        # A client that goes cancels the owner's upstream request.
        body = {"model": "hang", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        headers = {"x-contextpilot-session": session}
        with httpx.stream(
            "POST", f"{a}/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")
        wait_for(state.cancelled.is_set, what="the upstream saw the owner hang up")
        # The owner's refusal and its upstream's error reach the client in its API's shape.
        client_of_messages = anthropic.Anthropic(
            base_url=a, api_key="none", max_retries=0, default_headers=headers
        )
        refused = ("plain", "system", 422, "messages[0]")
        overloaded = ("error-529", "user", 529, "overloaded")
        for model, role, status, named in (refused, overloaded):
            with pytest.raises(anthropic.APIStatusError) as caught:
                client_of_messages.messages.create(
                    model=model,
                    max_tokens=5,
                    messages=[{"role": role, "content": "hi"}],  # type: ignore[list-item, misc]
                )
            assert caught.value.status_code == status
            assert caught.value.body["type"] == "error"  # type: ignore[index]
            assert named in caught.value.message
        assert _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="forwarded"} 4.0')


def test_a_mark_that_is_not_the_peers_is_ignored(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    with two_proxies(upstream) as (a, b):
        session = _owned_session(None, b, (a, b), "marked")
        for mark in ("guess", SECRET[:-1], f"{SECRET}0"):
            raw = _agent_call(a, [{"role": "user", "content": "hi"}], session)
            own = raw.headers[PLANNED_BY_HEADER]
            client = openai.OpenAI(base_url=f"{a}/v1", api_key="none", max_retries=0)
            forged = client.chat.completions.with_raw_response.create(
                model="plain",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-contextpilot-session": session, PEER_HEADER: mark},
            )
            assert forged.headers[PLANNED_BY_HEADER] == own  # still the owner's
        assert _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="bad_mark"} 3.0')
        assert _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="forwarded"} 6.0')
        assert not any(PEER_HEADER in r.headers for r in state.received)


def test_a_peer_that_is_down_leaves_its_calls_here(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    sock = bound_socket()
    here = f"http://127.0.0.1:{sock.getsockname()[1]}"
    down = closed_port_url()
    peers = PeerConfig((here, down), here, SECRET)
    with serve_proxy(upstream, {"peers": peers}, sock=sock) as a:
        session = _owned_session(None, down, (here, down), "orphan")
        raws = _converse((a, a, a), session)
        # Planned here from the first call on, as one conversation.
        assert all(raw.status_code == 200 for raw in raws)
        bodies = state.bodies("/v1/chat/completions")
        assert len(bodies) == 3
        _assert_one_conversation(bodies)
        assert raws[-1].headers["x-contextpilot-pointers"] == "1"
        assert _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="fallback"} 3.0')
        # Asked once (its /health refused), then passed over while it is down: no hop began.
        assert not _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="forwarded"}')


def test_a_peer_that_accepts_but_never_answers_leaves_its_calls_here(standin) -> None:  # type: ignore[no-untyped-def]
    upstream, state = standin
    sock = bound_socket()
    here = f"http://127.0.0.1:{sock.getsockname()[1]}"
    frozen = bound_socket()
    frozen.listen(16)  # the kernel completes connections; nobody reads them
    stuck = f"http://127.0.0.1:{frozen.getsockname()[1]}"
    peers = PeerConfig((here, stuck), here, SECRET)
    try:
        with serve_proxy(upstream, {"peers": peers}, sock=sock) as a:
            session = _owned_session(None, stuck, (here, stuck), "frozen")
            started = time.monotonic()
            raws = _converse((a, a, a), session)
            assert all(raw.status_code == 200 for raw in raws)
            # Its /health unanswered within 5 s: passed over, then planned here at once.
            assert time.monotonic() - started < 30
            assert _metric(a, 'contextpilot_proxy_peer_calls_total{outcome="fallback"} 3.0')
            _assert_one_conversation(state.bodies("/v1/chat/completions"))
    finally:
        frozen.close()


def test_the_owner_key_keeps_a_tenant_document_calls_together() -> None:
    opening = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    documents = {**opening, "contextpilot": {"documents": ["a", "b"]}}
    named = {**documents, "contextpilot": {"documents": ["a"], "conversation_id": "c1"}}

    def key(body: dict[str, Any], tenant: str | None = "alice") -> str | None:
        return owner_key(json.dumps(body).encode(), "openai", tenant, None)

    # Documents without a named conversation: the tenant's; other openings: their own.
    assert key(documents) == key({**documents, "messages": [{"role": "user", "content": "x"}]})
    assert key(documents) != key(documents, "bob")
    assert key(opening) != key(documents)
    # A named conversation is keyed by its id wherever the id comes from.
    assert key(named) == owner_key(b"{}", "openai", "alice", "c1") != key(documents)
    assert key({**opening, "user": "u"}) == owner_key(b"", "openai", "alice", "user:u")
    # Keys read as planning reads them: a NaN elsewhere in the body changes nothing.
    nan = json.dumps(opening)[:-1] + ', "temperature": NaN}'
    assert owner_key(nan.encode(), "openai", "alice", None) == key(opening)
    # Unreadable: handled where it arrives.
    for bad in (b"not json", b"[1]", b'{"messages": 3}', b'{"messages": [], "contextpilot": 1}'):
        assert owner_key(bad, "openai", "alice", None) is None
    assert owner_key(b"", "openai", "alice", "bad\x00id") is None


def test_rendezvous_order_spreads_keys_and_moves_few_when_a_peer_joins() -> None:
    two = ("http://p0:1", "http://p1:1")
    three = (*two, "http://p2:1")
    keys = [json.dumps(["conversation", "", f"c{i}"]) for i in range(400)]
    owners = [rendezvous_order(k, two)[0] for k in keys]
    assert 150 < owners.count(two[0]) < 250
    moved = [k for k, o in zip(keys, owners, strict=True) if rendezvous_order(k, three)[0] != o]
    assert all(rendezvous_order(k, three)[0] == three[2] for k in moved)
    assert rendezvous_order(keys[0], reversed(two)) == rendezvous_order(keys[0], two)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--peer", "http://a:1", "--peer", "http://b:1"], {PEER_SECRET_ENV: SECRET},
         "--peer-self"),
        (["--peer", "http://a:1", "--peer", "http://b:1", "--peer-self", "http://a:1"], {},
         PEER_SECRET_ENV),
        (["--peer", "http://a:1", "--peer", "http://b:1", "--peer-self", "http://a:1"],
         {PEER_SECRET_ENV: "short"}, "at least 16"),
        (["--peer", "http://a:1", "--peer", "http://b:1", "--peer-self", "http://c:1"],
         {PEER_SECRET_ENV: SECRET}, "must be one of"),
        (["--peer", "http://a:1", "--peer", "http://a:1/", "--peer-self", "http://a:1"],
         {PEER_SECRET_ENV: SECRET}, "twice"),
        (["--peer", "http://a:80", "--peer", "HTTP://A/v1/", "--peer-self", "http://a"],
         {PEER_SECRET_ENV: SECRET},
         "--peer[1] 'HTTP://A/v1' names the same process as 'http://a:80'"),
        (["--peer", "https://a", "--peer", "https://a:443", "--peer-self", "https://a"],
         {PEER_SECRET_ENV: SECRET}, "--peer[1] 'https://a:443' names the same process"),
        (["--peer", "http://a:1", "--peer", "http://a:99999", "--peer-self", "http://a:1"],
         {PEER_SECRET_ENV: SECRET}, "--peer[1] 'http://a:99999': Port out of range"),
        (["--peer", "http://127.0.0.1:1", "--peer", "http://user@127.0.0.1.:1",
          "--peer-self", "http://127.0.0.1:1"], {PEER_SECRET_ENV: SECRET}, "names the same"),
        (["--peer", "http://[::1]:1", "--peer", "http://[0:0:0:0:0:0:0:1]:1",
          "--peer-self", "http://[::1]:1"], {PEER_SECRET_ENV: SECRET}, "names the same"),
        (["--peer", "http://a:1", "--peer", "http://a:1/.", "--peer-self", "http://a:1"],
         {PEER_SECRET_ENV: SECRET}, "--peer[1] 'http://a:1/.': the path '/.' has '.'"),
        (["--peer", "http://a:1", "--peer-self", "http://a:1"], {PEER_SECRET_ENV: SECRET},
         "at least two"),
        (["--peer", "ftp://a:1", "--peer", "http://b:1", "--peer-self", "http://b:1"],
         {PEER_SECRET_ENV: SECRET}, "--peer[0]"),
    ],
)  # fmt: skip
def test_bad_peer_settings_are_refused_naming_them(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    args = build_parser().parse_args(["--upstream", "http://127.0.0.1:9/v1", *argv])
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        config_from_args(args, environ)


def test_peer_settings_from_the_command_line() -> None:
    args = build_parser().parse_args(
        ["--upstream", "http://127.0.0.1:9/v1", "--peer", "http://a:1/", "--peer", "http://b:1",
         "--peer-self", "http://b:1"]
    )  # fmt: skip
    proxy = config_from_args(args, {PEER_SECRET_ENV: SECRET}).proxy
    assert proxy is not None and proxy.peers is not None
    assert proxy.peers.urls == ("http://a:1", "http://b:1") and proxy.peers.own == "http://b:1"
    # Another spelling of a listed peer names it (kept as listed: the owner order reads it).
    args.peer_self = "HTTP://B:1/v1"
    assert config_from_args(args, {PEER_SECRET_ENV: SECRET}).proxy.peers.own == "http://b:1"  # type: ignore[union-attr]
    assert SECRET not in repr(proxy)
    bare = build_parser().parse_args(["--peer", "http://a:1", "--peer-self", "http://a:1"])
    with pytest.raises(ValueError, match="--peer, --peer-self need --upstream"):
        config_from_args(bare, {PEER_SECRET_ENV: SECRET})
    alone = build_parser().parse_args(["--peer-self", "http://a:1"])
    with pytest.raises(ValueError, match="^--peer-self needs --upstream"):
        config_from_args(alone, {PEER_SECRET_ENV: SECRET})


def test_the_hop_to_a_peer_shares_its_pool_between_tenants_as_the_upstreams_does() -> None:
    from prometheus_client import CollectorRegistry

    from contextpilot_integrations.service.proxy.peers import Peers

    here, there = "http://127.0.0.1:1", "http://127.0.0.1:2"
    proxy = ProxyConfig(
        "http://127.0.0.1:3/v1", max_connections=8, max_tenant_connections=2, pool_timeout_s=2.0
    )
    peers = Peers(PeerConfig((here, there), here, SECRET), proxy, CollectorRegistry())
    hop = peers._upstreams[there].config
    assert (hop.max_connections, hop.max_tenant_connections, hop.pool_timeout_s) == (8, 2, 2.0)


def test_calls_that_find_a_peers_health_stale_together_share_one_probe() -> None:
    import asyncio

    from prometheus_client import CollectorRegistry
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from support.asgi_server import serve_in_thread

    from contextpilot_integrations.service.proxy.peers import Peers

    asked: list[float] = []

    async def health(request: Any) -> PlainTextResponse:
        asked.append(time.monotonic())
        await asyncio.sleep(0.3)  # a slow peer: the calls arrive while it is asked
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/health", health)])
    with serve_in_thread(app) as there:
        here = closed_port_url()
        peers = Peers(
            PeerConfig((here, there), here, SECRET), ProxyConfig(there), CollectorRegistry()
        )

        async def calls() -> list[bool]:
            try:
                return await asyncio.gather(*(peers._alive(there) for _ in range(20)))
            finally:
                await peers.aclose()

        assert asyncio.run(calls()) == [True] * 20
    assert len(asked) == 1
