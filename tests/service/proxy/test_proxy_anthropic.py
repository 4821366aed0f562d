"""The proxy with the real anthropic SDK (sync, async, streaming, tool use) in front of a
stand-in Anthropic Messages upstream: a self-hosted engine's ``/v1/messages`` (engine fields)
and the hosted API (its key, ``cache_control`` breakpoints) (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import pytest
from proxy_testing import assert_replayed, serve_proxy
from upstream_standin import SEARCH_RESULT

SYSTEM = "You are a research agent. Use the search tool, then answer. " * 80
TOOLS = [
    {
        "name": "search",
        "description": "Search the corpus.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]


def _loop(client: anthropic.Anthropic) -> list[Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does the cache keep?"}]
    raws = []
    for _ in range(3):
        raw = client.messages.with_raw_response.create(
            model="agent",
            max_tokens=64,
            system=SYSTEM,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            metadata={"user_id": "user-3"},
        )
        raws.append(raw)
        message = raw.parse()
        messages.append({"role": "assistant", "content": [b.model_dump() for b in message.content]})
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": SEARCH_RESULT}
            for b in message.content
            if b.type == "tool_use"
        ]
        if results:
            messages.append({"role": "user", "content": results})
    return raws


def test_a_tool_using_conversation_to_a_self_hosted_messages_endpoint(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="client-secret", max_retries=0)
        raws = _loop(client)
        bodies = state.bodies("/v1/messages")
        assert_replayed(bodies[0]["messages"], bodies[1]["messages"])
        assert_replayed(bodies[1]["messages"], bodies[2]["messages"])
        results = [
            b["content"]
            for m in bodies[2]["messages"]
            if isinstance(m["content"], list)
            for b in m["content"]
            if b.get("type") == "tool_result"
        ]
        assert results[0] == SEARCH_RESULT
        assert results[1].startswith("[Same result as search(")
        assert raws[2].headers["x-contextpilot-pointers"] == "1"
        assert raws[2].headers["x-contextpilot-conversation"] == "user:user-3"
        for body, raw in zip(bodies, raws, strict=True):
            assert body["session_id"] == raw.headers["x-contextpilot-rid"]
            assert body["system"] == SYSTEM  # never rewritten
            assert "cache_control" not in json.dumps(body)  # a self-hosted engine: none
        for received in state.received:
            assert "x-api-key" not in received.headers
            assert "client-secret" not in json.dumps(received.headers)
        conversation = httpx.get(f"{proxy}/v1/usage").json()["conversations"][""]["user:user-3"]
        usages = [raw.parse().usage for raw in raws]
        assert conversation["usage_reports"] == 3
        assert conversation["prompt_tokens"] == sum(
            u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
            for u in usages
        )
        assert conversation["cached_tokens"] == sum(u.cache_read_input_tokens for u in usages) > 0


def test_the_hosted_api_gets_the_proxy_key_and_breakpoints(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"kind": "anthropic", "api_key": "sk-ant-proxy"}) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="client-secret", max_retries=0)
        raws = _loop(client)
    bodies = state.bodies("/v1/messages")
    for received in state.received:
        assert received.headers["x-api-key"] == "sk-ant-proxy"
        assert "client-secret" not in json.dumps(received.headers)
        assert "anthropic-version" in received.headers  # the SDK's own headers pass
    for body in bodies:
        assert not {"rid", "request_id", "session_id", "cache_salt"} & set(body)
    # The system prompt (long enough to cache) carries a breakpoint on every call; the third
    # call also one where its history ends.
    assert all(body["system"][-1]["cache_control"] == {"type": "ephemeral"} for body in bodies)
    marked = [
        i
        for i, m in enumerate(bodies[2]["messages"])
        if any("cache_control" in b for b in m["content"])
    ]
    assert marked == [len(bodies[2]["messages"]) - 2]
    assert raws[2].headers["x-contextpilot-breakpoints"] == "2"
    # The text sent is the text planned: markers aside, the third call's history is the second's.
    assert _unmarked(bodies[2]["messages"])[:3] == _unmarked(bodies[1]["messages"])


def _unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` without their ``cache_control`` markers."""
    marker = ', "cache_control": {"type": "ephemeral"}'
    return json.loads(json.dumps(messages).replace(marker, ""))  # type: ignore[no-any-return]


def test_streaming_sync_and_async_with_usage(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin

    async def run_async(proxy: str) -> str:
        client = anthropic.AsyncAnthropic(base_url=proxy, api_key="none", max_retries=0)
        async with client.messages.stream(
            model="plain",
            max_tokens=16,
            messages=[{"role": "user", "content": "async hello"}],
            extra_headers={"x-contextpilot-session": "s-async"},
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
        await client.close()
        return text

    with serve_proxy(url) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="none", max_retries=0)
        with client.messages.stream(
            model="agent",
            max_tokens=16,
            messages=[{"role": "user", "content": "find it"}],
            tools=TOOLS,  # type: ignore[arg-type]
            extra_headers={"x-contextpilot-session": "s-sync"},
        ) as stream:
            final = stream.get_final_message()
        assert final.content[0].type == "tool_use" and final.content[0].input == {"query": "alpha"}
        assert asyncio.run(run_async(proxy)) == "done"
        conversations = httpx.get(f"{proxy}/v1/usage").json()["conversations"][""]
        assert conversations["s-sync"]["usage_reports"] == 1
        assert conversations["s-sync"]["prompt_tokens"] == final.usage.input_tokens + (
            final.usage.cache_read_input_tokens or 0
        )
        assert conversations["s-async"]["usage_reports"] == 1
    assert all(body["stream"] is True for body in state.bodies("/v1/messages"))


def test_an_upstream_error_keeps_its_status_and_body(standin) -> None:  # type: ignore[no-untyped-def]
    url, _ = standin
    with serve_proxy(url) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="none", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(
                model="error-529", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
    assert caught.value.status_code == 529
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "overloaded"},
    }


def test_a_bad_message_is_refused_in_the_anthropic_shape(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="none", max_retries=0)
        with pytest.raises(anthropic.UnprocessableEntityError) as caught:
            client.messages.create(
                model="plain",
                max_tokens=8,
                messages=[{"role": "system", "content": "not a role here"}],  # type: ignore[list-item]
            )
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert "messages[0]" in caught.value.message
    assert state.received == []
