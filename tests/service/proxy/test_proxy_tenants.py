"""The proxy on a service with tenant keys: the tenant from the key, never from the body; two
tenants' conversations with the same id never share state; the tenant key never goes upstream
unless pass-through is configured (docs/DESIGN.md, "The proxy", "Tenants from credentials")."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI, Request, Response
from proxy_testing import serve_proxy
from support.asgi_server import serve_in_thread
from upstream_standin import SEARCH_RESULT

from contextpilot_integrations.service.tenants import TenantKeys

TENANTS = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}


def _messages(results: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "search twice"}]
    for i in range(results):
        arguments = json.dumps({"query": f"q{i}"})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {"name": "search", "arguments": arguments},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": SEARCH_RESULT})
    return messages


def test_tenants_with_the_same_conversation_id_never_share_state(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"api_key": "upstream-secret"}, tenants=TENANTS) as proxy:
        session = {"x-contextpilot-session": "same-id"}
        alice = openai.OpenAI(
            base_url=f"{proxy}/v1", api_key="alice-key", max_retries=0, default_headers=session
        )
        bob = openai.OpenAI(
            base_url=f"{proxy}/v1", api_key="bob-key", max_retries=0, default_headers=session
        )
        # Alice's conversation: one search, then a second with the same result (a pointer).
        alice.chat.completions.create(model="plain", messages=_messages(1))  # type: ignore[arg-type]
        alice_raw = alice.chat.completions.with_raw_response.create(
            model="plain",
            messages=_messages(2),  # type: ignore[arg-type]
        )
        # Bob sends only the second half under the same id: nothing of Alice's is replayed
        # or pointed at (his request holds one copy of the result, so it stays in full).
        only_second = [_messages(2)[0], *_messages(2)[3:]]
        bob_raw = bob.chat.completions.with_raw_response.create(
            model="plain",
            messages=only_second,  # type: ignore[arg-type]
        )
        assert alice_raw.headers["x-contextpilot-pointers"] == "1"
        assert bob_raw.headers["x-contextpilot-pointers"] == "0"
        assert bob_raw.headers["x-contextpilot-replayed"] == "0"
        bodies = state.bodies("/v1/chat/completions")
        assert bodies[2]["messages"][-1]["content"] == SEARCH_RESULT
        # Rids in each tenant's namespace; each tenant's own cache salt.
        alice_rid = alice_raw.headers["x-contextpilot-rid"]
        bob_rid = bob_raw.headers["x-contextpilot-rid"]
        assert alice_rid.split(".")[0] != bob_rid.split(".")[0]
        assert bodies[1]["cache_salt"] != bodies[2]["cache_salt"]
        assert bodies[0]["cache_salt"] == bodies[1]["cache_salt"]
        # No tenant key went upstream: the proxy's own key did.
        for received in state.received:
            assert received.headers["authorization"] == "Bearer upstream-secret"
            assert "alice-key" not in json.dumps(received.headers)
            assert "bob-key" not in json.dumps(received.headers)
        # Each tenant's totals hold its own conversation only.
        alice_usage = httpx.get(
            f"{proxy}/v1/usage", headers={"authorization": "Bearer alice-key"}
        ).json()
        bob_usage = httpx.get(
            f"{proxy}/v1/usage", headers={"authorization": "Bearer bob-key"}
        ).json()
        assert alice_usage["conversations"] == {
            "alice": {"same-id": alice_usage["conversations"]["alice"]["same-id"]}
        }
        assert alice_usage["conversations"]["alice"]["same-id"]["plans"] == 2
        assert bob_usage["conversations"]["bob"]["same-id"]["plans"] == 1
        assert alice_usage["tokens_removed"] > 0 and bob_usage["tokens_removed"] == 0


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_unknown_key_is_refused_and_nothing_is_forwarded(  # type: ignore[no-untyped-def]
    standin, key: str | None
) -> None:
    url, state = standin
    with serve_proxy(url, {"api_key": "upstream-secret"}, tenants=TENANTS) as proxy:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        chat = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
            headers=headers,
        )
        models = httpx.get(f"{proxy}/v1/models", headers=headers)
    assert chat.status_code == models.status_code == 401
    assert chat.json()["error"]["type"] == "authentication_error"
    assert state.received == []


def test_the_anthropic_sdk_key_is_the_tenant_key(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"api_key": "upstream-secret"}, tenants=TENANTS) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="bob-key", max_retries=0)
        raw = client.messages.with_raw_response.create(
            model="plain", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        usage = httpx.get(f"{proxy}/v1/usage", headers={"x-api-key": "bob-key"})
    assert raw.parse().content[0].text == "done"  # type: ignore[union-attr]
    assert usage.status_code == 401  # the service's own endpoints take a bearer key only
    headers = state.received[0].headers
    assert headers["authorization"] == "Bearer upstream-secret"
    assert "bob-key" not in json.dumps(headers)
    assert state.received[0].body["cache_salt"]


def test_with_pass_through_the_tenant_key_stays_and_the_client_key_goes(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"pass_client_key": True}, tenants=TENANTS) as proxy:
        client = openai.OpenAI(
            base_url=f"{proxy}/v1",
            api_key="users-own-upstream-key",
            max_retries=0,
            default_headers={"x-contextpilot-api-key": "alice-key"},
        )
        raw = client.chat.completions.with_raw_response.create(
            model="plain", messages=[{"role": "user", "content": "hi"}]
        )
    assert raw.headers["x-contextpilot-rid"].count(".") == 1  # alice's namespace
    headers = state.received[0].headers
    assert headers["authorization"] == "Bearer users-own-upstream-key"
    assert "x-contextpilot-api-key" not in headers
    assert "alice-key" not in json.dumps(headers)


def test_a_tenant_key_is_never_read_from_credentials_that_go_upstream(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    with serve_proxy(url, {"pass_client_key": True}, tenants=TENANTS) as proxy:
        # The tenant key as the client's upstream key: refused, not forwarded upstream.
        for header in ({"authorization": "Bearer alice-key"}, {"x-api-key": "alice-key"}):
            answer = httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=header)
            assert answer.status_code == 401, answer.text
    assert state.received == []


def test_keys_of_two_tenants_in_one_request_are_refused(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    with serve_proxy(url, {}, tenants=TENANTS) as proxy:
        both = {"authorization": "Bearer alice-key", "x-contextpilot-api-key": "bob-key"}
        answer = httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=both)
        assert answer.status_code == 401 and "two tenants" in answer.text
        # One tenant's key twice, or beside a key that is no tenant's, is that tenant.
        same = {"authorization": "Bearer alice-key", "x-api-key": "alice-key"}
        assert httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=same).is_success
    assert len(state.received) == 1


def test_an_upstream_cookie_never_goes_out_with_another_tenants_request() -> None:
    """The upstream's ``Set-Cookie`` reaches the client that got it; the proxy's pooled client,
    shared by all tenants, keeps none of it for later requests."""
    seen: list[str | None] = []
    upstream = FastAPI()

    @upstream.get("/v1/models")
    async def models(request: Request) -> Response:
        seen.append(request.headers.get("cookie"))
        response = Response('{"object": "list", "data": []}', media_type="application/json")
        response.set_cookie("upstream_session", "alice-secret", path="/")
        return response

    with serve_in_thread(upstream) as url, serve_proxy(f"{url}/v1", tenants=TENANTS) as proxy:
        first = httpx.get(f"{proxy}/v1/models", headers={"authorization": "Bearer alice-key"})
        second = httpx.get(f"{proxy}/v1/models", headers={"authorization": "Bearer bob-key"})
        own = httpx.get(
            f"{proxy}/v1/models",
            headers={"authorization": "Bearer bob-key", "cookie": "mine=1"},
        )
    assert first.status_code == second.status_code == own.status_code == 200
    assert "alice-secret" in first.headers["set-cookie"]
    assert seen == [None, None, "mine=1"]
